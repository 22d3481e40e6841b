"""Read-only views of both tiers for `spmd ckpt ls` and `spmd ckpt verify`.

One word per state, the same in `spmd ckpt ls`, `spmd ckpt verify` and
docs/checkpointing.md: a local rank copy is `committed` (its marker reads), `written` (no
marker yet), `damaged` (a marker that does not read) or `partial` (tmp dir); a persistent step
is `committed` (its manifest reads), `unverified` (Orbax finalized it, no manifest),
`damaged` (a manifest that does not read: truncated, not JSON, another format) or `partial`
(Orbax's tmp dir). `verify` reports every `damaged` one as a problem, naming the step.

Listing and checksums need no JAX. `verify_local(..., nonfinite=[])` also counts NaN/Inf in
the parameters of the blobs it reads anyway (numpy); `nonfinite_persistent_steps` reads a
persistent step's parameters through Orbax only when its manifest does not already vouch for
them (`params_finite: true`, and its checksums pass).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spmd.checkpoint.files import ChecksumError, crc32, hex32, read_json, tree_size
from spmd.checkpoint.finite import describe_nonfinite, nonfinite_in_blob
from spmd.checkpoint.local import DATA, INDEX, MARKER
from spmd.checkpoint.persistent import MANIFEST, read_manifest, verify_files

_RANK = re.compile(r"^rank(\d+)(\.tmp)?$")
_ORBAX_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


@dataclass
class RankCopy:
    rank: int
    state: str                  # committed | written (no marker) | damaged | partial (tmp)
    bytes: int
    partners: list[int] = field(default_factory=list)   # ranks whose copies it holds
    problem: str = ""           # damaged: what is wrong with the marker
    host: str = ""              # the host that committed it (its marker), "" if unknown


@dataclass
class LocalStep:
    step: int
    ranks: list[RankCopy]
    num_processes: int | None
    committed: bool             # every rank restorable from an own or partner copy


@dataclass
class PersistentStep:
    step: int
    state: str        # committed | unverified (no manifest) | damaged | partial (Orbax tmp)
    bytes: int
    files: int
    problem: str = ""           # damaged: what is wrong with the manifest


def scan_local(root: Path) -> list[LocalStep]:
    out = []
    if not root.is_dir():
        return out
    for step_dir in sorted((p for p in root.iterdir() if p.name.isdigit() and p.is_dir()),
                           key=lambda p: int(p.name)):
        copies, nprocs = [], None
        for d in sorted(step_dir.iterdir()):
            m = _RANK.match(d.name)
            if not m or not d.is_dir():
                continue
            rank = int(m.group(1))
            marker, problem = None, ""
            if not m.group(2) and (d / MARKER).is_file():
                try:
                    marker = read_json(d / MARKER)
                except (OSError, ChecksumError) as e:
                    problem = _unreadable(d / MARKER, e)
                if marker is not None and not isinstance(marker, dict):
                    marker, problem = None, f"{d / MARKER}: not a JSON object"
            state = ("partial" if m.group(2) else "committed" if marker
                     else "damaged" if problem else "written")
            partners = list(marker.get("partners", [])) if marker else []
            if marker:
                nprocs = marker.get("num_processes", nprocs)
            host = str(marker.get("host", "")) if marker else ""
            copies.append(RankCopy(rank, state, tree_size(d), partners, problem, host))
        have = {c.rank for c in copies if c.state == "committed"}
        have |= {q for c in copies if c.state == "committed" for q in c.partners}
        committed = nprocs is not None and all(r in have for r in range(nprocs))
        out.append(LocalStep(int(step_dir.name), copies, nprocs, committed))
    return out


def scan_persistent(root: Path) -> list[PersistentStep]:
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        if not d.is_dir():
            continue
        tmp = _ORBAX_TMP.match(d.name)
        if tmp:
            out.append(PersistentStep(int(tmp.group(1)), "partial", tree_size(d), 0))
        elif d.name.isdigit():
            m = read_manifest(d)
            files = len(m["files"]) if m else sum(1 for p in d.rglob("*") if p.is_file())
            problem = "" if m is not None else manifest_problem(d)
            state = "committed" if m else "damaged" if problem else "unverified"
            out.append(PersistentStep(int(d.name), state, tree_size(d), files, problem))
    return sorted(out, key=lambda s: (s.step, s.state))


def manifest_problem(step_dir: Path) -> str:
    """What is wrong with a persistent step's manifest that `read_manifest` refused ("": there
    is none, the step is `unverified`)."""
    path = step_dir / MANIFEST
    if not path.exists() and not path.is_symlink():
        return ""
    try:
        doc = read_json(path)
    except (OSError, ChecksumError) as e:
        return _unreadable(path, e)
    if not isinstance(doc, dict):
        return f"{path}: not a JSON object"
    return f"{path}: format {doc.get('format')!r}, not spmd's manifest"


def _unreadable(path: Path, e: Exception) -> str:
    if isinstance(e, ChecksumError):
        return str(e)
    if isinstance(e, OSError):
        return f"{path}: cannot be read ({e.strerror or e})"
    return f"{path}: {e}"


def verify_local(root: Path, nonfinite: list[dict] | None = None) -> tuple[list[str], int]:
    """(problems naming files, number of files checked) for every committed rank copy.

    `nonfinite`: a list to extend with one record per step and parameter holding NaN/Inf
    (`describe_nonfinite`: step, where, param, nonfinite count, size), counted over the
    blobs checked (each piece once, own copy or partner's).
    """
    problems, checked = [], 0
    for step in scan_local(root):
        counts: dict[tuple[str, str], tuple[int, int]] = {}
        for c in step.ranks:
            if c.state == "damaged":
                problems.append(f"local step {step.step}, rank {c.rank}: damaged marker: "
                                f"{c.problem}")
            if c.state != "committed":
                continue
            d = root / str(step.step) / f"rank{c.rank:05d}"
            try:
                marker = read_json(d / MARKER)
            except (OSError, ChecksumError) as e:
                problems.append(f"{d / MARKER}: unreadable ({e})")
                continue
            pairs = [(INDEX, DATA)] + [(f"partner-rank{q:05d}.json", f"partner-rank{q:05d}.bin")
                                       for q in marker.get("partners", [])]
            for index_name, data_name in pairs:
                checked += 2
                problems += _verify_blob(d / index_name, d / data_name,
                                         marker.get("files", {}).get(index_name),
                                         counts if nonfinite is not None else None)
        if nonfinite is not None:
            per_param: dict[str, tuple[int, int]] = {}
            for (param, _), (n, size) in counts.items():
                have = per_param.get(param, (0, 0))
                per_param[param] = (have[0] + n, have[1] + size)
            nonfinite += [{"tier": "local", **r} for r in
                          describe_nonfinite(root / str(step.step), step.step, per_param)]
    return problems, checked


def _verify_blob(index_path: Path, data_path: Path, index_crc: str | None,
                 counts: dict | None = None) -> list[str]:
    try:
        index = read_json(index_path, index_crc)
    except FileNotFoundError:
        return [f"{index_path}: missing"]
    except (OSError, ChecksumError) as e:
        return [str(e) if isinstance(e, ChecksumError) else f"{index_path}: {e}"]
    try:
        blob = data_path.read_bytes()
    except OSError as e:
        return [f"{data_path}: cannot be read ({e.strerror or e})"]
    if len(blob) != index["nbytes"]:
        return [f"{data_path}: {len(blob)} bytes, the index says {index['nbytes']}"]
    view = memoryview(blob)
    bad = [p for p in index["pieces"]
           if hex32(crc32(view[p["offset"]:p["offset"] + p["nbytes"]])) != p["crc32"]]
    if counts is not None and not bad:
        for key, value in nonfinite_in_blob(view, index["pieces"]).items():
            counts.setdefault(key, value)
    return [f"{data_path}: {len(bad)} of {len(index['pieces'])} pieces fail their crc32 "
            f"(first: {bad[0]['path']} at offset {bad[0]['offset']})"] if bad else []


def verify_persistent(root: Path) -> tuple[list[str], int]:
    problems, checked = [], 0
    for step in scan_persistent(root):
        d = root / str(step.step)
        if step.state == "damaged":
            problems.append(f"persistent step {step.step}: damaged manifest: {step.problem}")
            continue
        if step.state != "committed":
            continue
        manifest = read_manifest(d)
        if manifest is None:
            problems.append(f"persistent step {step.step}: damaged manifest: "
                            f"{manifest_problem(d) or f'{d / MANIFEST}: gone'}")
            continue
        checked += len(manifest["files"])
        problems += verify_files(d, manifest, 0, 1)
    return problems, checked


def nonfinite_persistent_steps(root: Path) -> tuple[list[dict], list[str]]:
    """(one record per committed step and parameter holding NaN/Inf, problems reading them).

    A step whose manifest says `params_finite: true` is not read (its checksums vouch for
    the bytes that were found finite when it was saved); any other is read onto the host.
    """
    from spmd.checkpoint.persistent import nonfinite_persistent

    records, problems = [], []
    for step in scan_persistent(root):
        if step.state != "committed":
            continue
        d = root / str(step.step)
        manifest = read_manifest(d)
        if manifest is not None and manifest.get("params_finite") is True:
            continue
        try:
            counts = nonfinite_persistent(d)
        except Exception as e:
            problems.append(f"{d}: its parameters cannot be read to check them for NaN/Inf "
                            f"({type(e).__name__}: {str(e)[:300]})")
            continue
        records += [{"tier": "persistent", **r}
                    for r in describe_nonfinite(d, step.step, counts)]
    return records, problems


def nonfinite_text(record: dict) -> str:
    """One line naming tier, step, directory, parameter and count of a non-finite record."""
    return (f"{record['tier']} step {record['step']} ({record['where']}): parameter "
            f"{record['param']} holds {record['nonfinite']} non-finite value(s) (NaN/Inf) of "
            f"{record['size']}")


def as_dict(obj: object) -> dict:
    return asdict(obj)  # type: ignore[call-overload]
