"""Per-channel statistics of stored fields, for training on normalized data (data.normalize).

For each dataset path of `data.path` (one store, a directory of stores or a glob: the
concatenation of spmd.data.formats.file_index), over its first `rows` records: per channel (the
stored last axis) the count, mean, population standard deviation (ddof=0), minimum and
maximum. A dataset without a channel axis has one "channel": all its values.

CF-coded NetCDF4 / Zarr variables (packed, fill values) are decoded as xarray decodes them
(spmd.data.cf.cf_decode), per member file, before the statistics are taken: as ArraySource
reads them.

Missing values: NaN (and +-inf) are left out, per channel: `count` is the channel's valid
values and `missing` the ones left out (a land mask over the sea-surface temperature, say).
A channel with no valid value at all is an error naming the dataset and the channel, so the
statistics file, and the run's normalization.json made from it, never holds NaN; a file
written before (a NaN mean or std) is refused with the command to rerun. Files of the older
form (one count for every channel, no `missing`) read as before.

Invariants:
- Values are accumulated in float64, block by block (at most `BLOCK_BYTES` of float64 per
  block), and blocks and ranks are combined with the parallel formula of Chan, Golub &
  LeVeque (counts n_a, n_b; delta = mean_b - mean_a; mean = mean_a + delta n_b / n;
  M2 = M2_a + M2_b + delta^2 n_a n_b / n), so the result does not depend on the block
  size or the rank count beyond rounding.
- Rank r of s takes records [r N // s, (r + 1) N // s) of each dataset (N its rows) and
  opens only the members holding them, each once (the cached index gives their sizes).
- A partial result (`partial_statistics`) and a merged one (`merge_statistics`) are plain
  JSON-able dicts; floats round-trip exactly through `json`.
- The statistics are stored beside the data (`statistics_file`): `P.stats.json` next to a
  store `P`, `<dir>/stats.json` in a directory of stores, `stats-<hash>.json` next to a
  glob's index; written atomically (spmd.atomic_write: a temporary name, then os.replace).
  The file holds each dataset's split and rows and the data's fingerprint (every member's
  size and mtime), so `load_statistics` refuses statistics of data changed since; every
  error names the file and the command that computes them, `spmd data stats CONFIG`.
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spmd.atomic_write import write_atomic
from spmd.data.cf.cf_decode import decode, stored_coding
from spmd.data.formats.file_index import check_unchanged, has_magic, load_index, resolve
from spmd.data.formats.stores import ArrayDataError, Store, fingerprint

__all__ = ["BLOCK_BYTES", "FieldStatistics", "Moments", "compute_statistics",
           "data_fingerprint", "load_statistics", "merge_statistics", "partial_statistics",
           "rank_rows", "statistics_file", "write_statistics"]

STATS_VERSION = 1
BLOCK_BYTES = 64 * 2**20            # float64 bytes of one block of rows
STD_FLOOR_REL = 1e-6                # std floor relative to |mean| (a constant channel)
STD_FLOOR_ABS = 1e-30               # absolute std floor (a channel of zeros)
COMMAND = "spmd data stats CONFIG"


@dataclass(frozen=True)
class FieldStatistics:
    """One dataset's statistics: float64 arrays of shape (channels,)."""

    count: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @property
    def channels(self) -> int:
        return int(self.mean.shape[0])

    def scale(self) -> np.ndarray:
        """The std to divide by: floored at a tiny epsilon (1e-6 |mean|, at least 1e-30),
        so a constant channel normalizes to 0 instead of dividing by 0."""
        floor = np.maximum(STD_FLOOR_REL * np.abs(self.mean), STD_FLOOR_ABS)
        return np.maximum(self.std, floor)


def rank_rows(rows: int, rank: int, size: int) -> tuple[int, int]:
    """Records [lo, hi) of `rows` that rank `rank` of `size` takes (contiguous ranges)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of {size} ranks")
    return rows * rank // size, rows * (rank + 1) // size


# ---------------------------------------------------------------- moments


@dataclass
class Moments:
    """Per channel: the count of valid (finite) values, their mean, M2 (sum of squared
    deviations), min and max. A channel without values has count 0, mean 0, M2 0 and min
    +inf, max -inf (None in JSON). `Moments.of` a block, then `combine` the blocks: the
    std of a field of large mean keeps float64 precision (no sum of squares)."""

    n: np.ndarray                 # int64 (channels,)
    mean: np.ndarray
    m2: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    missing: np.ndarray           # int64 (channels,): NaN / inf values left out

    @classmethod
    def empty(cls, channels: int) -> Moments:
        zeros = np.zeros(channels, np.float64)
        counts = np.zeros(channels, np.int64)
        return cls(counts, zeros, zeros.copy(), np.full(channels, np.inf),
                   np.full(channels, -np.inf), counts.copy())

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        """The moments of the finite values of `values` (rows, channels), float64."""
        valid = np.isfinite(values)
        n = valid.sum(axis=0).astype(np.int64)
        if n.sum() == values.size:                   # the common case: no missing value
            mean = values.mean(axis=0)
            return cls(n, mean, ((values - mean) ** 2).sum(axis=0), values.min(axis=0),
                       values.max(axis=0), np.zeros_like(n))
        safe = np.maximum(n, 1)
        mean = np.where(valid, values, 0.0).sum(axis=0) / safe
        m2 = np.where(valid, (values - mean) ** 2, 0.0).sum(axis=0)
        lo = np.where(valid, values, np.inf).min(axis=0)
        hi = np.where(valid, values, -np.inf).max(axis=0)
        return cls(n, mean, m2, lo, hi, values.shape[0] - n)

    def combine(self, other: Moments) -> Moments:
        """Chan, Golub & LeVeque's pairwise update, per channel."""
        n = self.n + other.n
        safe = np.maximum(n, 1)
        delta = other.mean - self.mean
        mean = np.where(other.n == 0, self.mean,
                        np.where(self.n == 0, other.mean, self.mean + delta * (other.n / safe)))
        m2 = self.m2 + other.m2 + delta**2 * (self.n * other.n / safe)
        return Moments(n, mean, m2, np.minimum(self.lo, other.lo),
                        np.maximum(self.hi, other.hi), self.missing + other.missing)

    def to_json(self) -> dict[str, Any]:
        def bound(values: np.ndarray) -> list[float | None]:
            return [float(v) if np.isfinite(v) else None for v in values]

        return {"count": self.n.tolist(), "missing": self.missing.tolist(),
                "mean": self.mean.tolist(), "m2": self.m2.tolist(),
                "min": bound(self.lo), "max": bound(self.hi)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], channels: int) -> Moments:
        """A partial result: per-channel counts, or (older) one count for every channel."""
        count = np.broadcast_to(np.asarray(doc["count"], np.int64), (channels,)).copy()
        if not count.any():
            return cls.empty(channels)

        def bound(values: Any, fill: float) -> np.ndarray:
            values = values if isinstance(values, list) else [values] * channels
            return np.asarray([fill if v is None else v for v in values], np.float64)

        missing = np.asarray(doc.get("missing", [0] * channels), np.int64)
        return cls(count, np.asarray(doc["mean"], np.float64), np.asarray(doc["m2"], np.float64),
                   bound(doc["min"], np.inf), bound(doc["max"], -np.inf), missing)


# ---------------------------------------------------------------- partial statistics


def partial_statistics(path: str | Path, plan: Mapping[str, tuple[bool, int]], *,
                       rank: int = 0, size: int = 1, where: str = "data.path",
                       block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """This rank's statistics of each dataset of `plan` ({dataset path: (per_channel,
    rows)}): of records [rank rows // size, (rank + 1) rows // size) of the first `rows`.

    Returns a JSON-able dict: `datasets` (per dataset: per_channel, channels, rows, the
    record range, count, mean, m2, min, max) and `opened` (the member files this rank
    opened, in order). Raises ArrayDataError naming the file, dataset and `where`."""
    files = load_index(path, where)
    members = files.members
    shapes: dict[str, list[tuple[int, ...]]] = {}
    if files.multi:
        for dataset in plan:
            shapes[dataset] = []
            for member in members:
                if member.datasets is None or dataset not in member.datasets:
                    raise ArrayDataError(f"{where}: file {member.path}: dataset '{dataset}' is "
                                         f"missing (data.fields); every file must hold it")
                shapes[dataset].append(tuple(member.datasets[dataset][0]))
    else:
        store = Store(members[0].path, where, members[0].format)
        try:
            for dataset in plan:
                shapes[dataset] = [tuple(store.get(dataset, "data.fields").shape)]
        finally:
            store.close()

    # which member rows each dataset needs: member -> [(dataset, lo, hi)]
    work: dict[int, list[tuple[str, int, int]]] = {}
    out: dict[str, Any] = {}
    moments: dict[str, Moments] = {}
    for dataset, (per_channel, rows) in plan.items():
        dims = shapes[dataset]
        example = dims[0][1:]
        total = sum(d[0] for d in dims)
        if rows > total:
            raise ArrayDataError(f"{where}: dataset '{dataset}' holds {total} records but "
                                 f"statistics of {rows} are asked for; lower the record count "
                                 f"(data.num_train / data.num_test) or use more data")
        channel = bool(per_channel) and len(example) > 0
        channels = int(example[-1]) if channel else 1
        lo, hi = rank_rows(int(rows), rank, size)
        out[dataset] = {"per_channel": channel, "channels": channels, "rows": int(rows),
                        "range": [lo, hi]}
        moments[dataset] = Moments.empty(channels)
        offset = 0
        for i, d in enumerate(dims):
            a, b = max(lo, offset), min(hi, offset + d[0])
            if a < b:
                work.setdefault(i, []).append((dataset, a - offset, b - offset))
            offset += d[0]

    opened: list[str] = []
    for i in sorted(work):
        member = members[i]
        label = f"{where}: file {member.path}" if files.multi else where
        before = member.stamp or fingerprint(member.path)
        store = Store(member.path, label, member.format)
        opened.append(str(member.path))
        try:
            for dataset, a, b in work[i]:
                array = store.get(dataset, "data.fields")
                coding = stored_coding(member.path, store.format, dataset,
                                       getattr(array, "attrs", None), label)
                channels = out[dataset]["channels"]
                per_row = max(1, math.prod(array.shape[1:]))
                step = max(1, block_bytes // (8 * per_row))
                for start in range(a, b, step):
                    block = _read(array, start, min(b, start + step), label, dataset)
                    if coding is not None:          # as ArraySource reads it
                        block = decode(block, coding).astype(np.float64, copy=False)
                    moments[dataset] = moments[dataset].combine(
                        Moments.of(block.reshape(-1, channels)))
        finally:
            store.close()
        check_unchanged(member.path, before, label, "while its statistics were computed "
                        "(nothing was written)")
    for dataset, m in moments.items():
        out[dataset].update(m.to_json())
    return {"datasets": out, "opened": opened}


def _read(array: Any, start: int, stop: int, where: str, dataset: str) -> np.ndarray:
    try:
        return np.asarray(array[start:stop], dtype=np.float64)
    except (OSError, KeyError, RuntimeError, ValueError) as e:   # a damaged chunk
        raise ArrayDataError(f"{where}: reading rows [{start}, {stop}) of dataset "
                             f"'{dataset}' failed ({type(e).__name__}: {e}); the file may "
                             f"be truncated or corrupt (left unchanged)") from None


def merge_statistics(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The statistics of several partial results (of disjoint records, e.g. one per rank,
    in any order), in the same form; the record ranges must tile one range."""
    if not parts:
        raise ValueError("merge_statistics: no partial statistics")
    names = list(parts[0]["datasets"])
    out: dict[str, Any] = {}
    for dataset in names:
        entries = [p["datasets"][dataset] for p in parts]
        first = entries[0]
        for e in entries:
            if (e["rows"], e["channels"], e["per_channel"]) != (
                    first["rows"], first["channels"], first["per_channel"]):
                raise ValueError(f"merge_statistics: partial statistics of '{dataset}' "
                                 f"disagree on rows, channels or per_channel: {e} vs {first}")
        ranges = sorted(tuple(e["range"]) for e in entries)
        for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
            if hi != lo:
                raise ValueError(f"merge_statistics: partial statistics of '{dataset}' cover "
                                 f"records {ranges}, which are not one contiguous range")
        total = Moments.empty(first["channels"])
        for e in sorted(entries, key=lambda e: e["range"][0]):
            total = total.combine(Moments.from_json(e, first["channels"]))
        out[dataset] = {"per_channel": first["per_channel"], "channels": first["channels"],
                        "rows": first["rows"], "range": [ranges[0][0], ranges[-1][1]],
                        **total.to_json()}
    return {"datasets": out}


# ---------------------------------------------------------------- the file beside the data


def statistics_file(path: str | Path, where: str = "data.path") -> Path:
    """Where the statistics of `data.path` are stored: `P.stats.json` beside a store `P`,
    `<dir>/stats.json` in a directory of stores, `stats-<hash>.json` beside a glob's index
    (`<the glob's fixed directory>/.spmd_index-<hash>.json`)."""
    text = str(path)
    if not has_magic(text):
        p = Path(text)
        if not p.is_dir():
            return p.with_name(p.name + ".stats.json")
    _, _, cache = resolve(path, where)
    if cache is None:                                   # a single store directory
        p = Path(text)
        return p.with_name(p.name + ".stats.json")
    if has_magic(text):
        return cache.with_name(cache.name.replace(".spmd_index-", "stats-", 1))
    return cache.parent / "stats.json"


def data_fingerprint(path: str | Path, where: str = "data.path") -> dict[str, dict[str, int]]:
    """Every member's size and mtime (spmd.data.formats.stores.fingerprint), by its name relative
    to the dataset's base directory (as in the index)."""
    paths, base, cache = resolve(path, where)
    out = {}
    for p in paths:
        if not p.exists():
            raise ArrayDataError(f"{where}: file {p}: no such file or directory on this host")
        try:
            name = p.name if cache is None else str(p.relative_to(base))
        except ValueError:
            name = str(p)
        out[name] = fingerprint(p)
    return out


def write_statistics(path: str | Path, stats: Mapping[str, Any], *, split: str,
                     fingerprint: Mapping[str, Any] | None = None,
                     where: str = "data.path",
                     channel_names: Mapping[str, Sequence[str]] | None = None) -> Path:
    """Store merged statistics (`merge_statistics`) of split `split` beside the data,
    atomically. `fingerprint`: the data's, taken before reading (default: now). Datasets
    already in the file for the same data are kept; a file of other data is replaced.

    Per channel the file holds `count` (its valid values) and `missing` (NaN / inf values
    left out). A channel without any valid value is an ArrayDataError naming the dataset and
    the channel (`channel_names`: {dataset: names}, else its index): nothing is written, so
    the file never holds NaN."""
    target = statistics_file(path, where)
    stamp = dict(fingerprint) if fingerprint is not None else data_fingerprint(path, where)
    datasets: dict[str, Any] = {}
    try:
        old = json.loads(target.read_text())
        if old.get("version") == STATS_VERSION and old.get("fingerprint") == stamp:
            datasets.update(old.get("datasets", {}))
    except (OSError, ValueError, AttributeError):
        pass
    for dataset, e in stats["datasets"].items():
        if list(e["range"]) != [0, e["rows"]]:
            raise ValueError(f"write_statistics: statistics of '{dataset}' cover records "
                             f"{e['range']}, not all {e['rows']} (a rank's part missing?)")
        m = Moments.from_json(e, int(e["channels"]))
        empty = [c for c in range(int(e["channels"])) if m.n[c] == 0]
        if empty:
            names = (channel_names or {}).get(dataset)
            label = ", ".join(_channel_label(c, names, e["per_channel"]) for c in empty[:8])
            raise ArrayDataError(
                f"{where}: dataset '{dataset}' {label}: no valid value in {e['rows']} records "
                f"(all NaN or missing), so no mean or std; drop the channel from the data "
                f"(data.variables) or fix the file (nothing was written)")
        std = np.sqrt(np.maximum(m.m2 / m.n, 0.0))
        values = (m.mean, std, m.lo, m.hi)
        if not all(np.all(np.isfinite(v)) for v in values):     # inf - inf, overflow
            raise ArrayDataError(f"{where}: dataset '{dataset}': statistics not finite "
                                 f"(mean {m.mean.tolist()}, std {std.tolist()}); values too "
                                 f"large for float64?")
        datasets[dataset] = {"split": split, "rows": e["rows"], "per_channel": e["per_channel"],
                             "count": m.n.tolist(), "missing": m.missing.tolist(),
                             "mean": m.mean.tolist(), "std": std.tolist(),
                             "min": m.lo.tolist(), "max": m.hi.tolist()}
    doc = {"version": STATS_VERSION, "data": str(path), "fingerprint": stamp,
           "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname(),
           "datasets": dict(sorted(datasets.items()))}
    try:
        write_atomic(target, json.dumps(doc, indent=1) + "\n", durable=False)
    except OSError as e:
        raise ArrayDataError(f"{where}: cannot write the statistics file {target} ({e}); "
                             f"make its directory writable and rerun `{COMMAND}`") from None
    return target


def load_statistics(path: str | Path, datasets: Iterable[str] | None = None, *,
                    rows: Mapping[str, int] | None = None,
                    where: str = "data.path") -> dict[str, FieldStatistics]:
    """The stored statistics of `datasets` (default: all in the file), checked against the
    data now on disk and, for the datasets of `rows`, against the records used. Raises
    ArrayDataError naming the file and `spmd data stats CONFIG` when they are missing or
    stale."""
    target = statistics_file(path, where)
    rerun = f"compute them with `{COMMAND}`"
    try:
        doc = json.loads(target.read_text())
    except FileNotFoundError:
        raise ArrayDataError(f"{where}: no normalization statistics (data.normalize is true): "
                             f"{target} is missing; {rerun}") from None
    except (OSError, ValueError) as e:
        raise ArrayDataError(f"{where}: the statistics file {target} is unreadable ({e}); "
                             f"{rerun} again") from None
    if not isinstance(doc, dict) or doc.get("version") != STATS_VERSION:
        raise ArrayDataError(f"{where}: the statistics file {target} is not of version "
                             f"{STATS_VERSION}; {rerun} again")
    _check_fresh(doc.get("fingerprint") or {}, data_fingerprint(path, where), path, target,
                 where)
    stored = doc.get("datasets") or {}
    out = {}
    for dataset in (list(stored) if datasets is None else list(datasets)):
        e = stored.get(dataset)
        if e is None:
            raise ArrayDataError(f"{where}: the statistics file {target} has no dataset "
                                 f"'{dataset}' (it has {sorted(stored)}); {rerun} (with "
                                 f"--split for a test split)")
        want = None if rows is None else rows.get(dataset)
        if want is not None and int(e["rows"]) != int(want):
            raise ArrayDataError(
                f"{where}: the statistics in {target} of dataset '{dataset}' cover "
                f"{e['rows']} records but {want} are used now (data.num_train changed?); "
                f"{rerun} again")
        try:
            stats = FieldStatistics(*(np.asarray(e[k], np.float64)
                                      for k in ("count", "mean", "std", "min", "max")))
        except (KeyError, TypeError, ValueError) as err:
            raise ArrayDataError(f"{where}: the statistics file {target} is malformed at "
                                 f"'{dataset}' ({err}); {rerun} again") from None
        bad = [c for c in range(stats.channels)
               if not (np.isfinite(stats.mean[c]) and np.isfinite(stats.std[c]))]
        if bad:     # a file written before the statistics were NaN-aware
            raise ArrayDataError(
                f"{where}: the statistics file {target} holds a non-finite mean or std for "
                f"dataset '{dataset}' channel(s) {bad} (NaN in the data, computed before "
                f"statistics left NaN out); {rerun} again")
        out[dataset] = stats
    return out


def _check_fresh(stored: Mapping[str, Any], now: Mapping[str, Any], path: str | Path,
                 target: Path, where: str) -> None:
    """The data are those the statistics were computed of, else an error naming the file."""
    files = Path(str(path))
    _, base, cache = resolve(path, where)

    def full(name: str) -> Path:
        return files if cache is None else base / name

    rerun = f"rerun `{COMMAND}` (statistics in {target})"
    for name, stamp in stored.items():
        if name not in now:
            raise ArrayDataError(f"{where}: file {full(name)} is gone since its statistics "
                                 f"were computed; {rerun}")
        if dict(now[name]) != dict(stamp):
            raise ArrayDataError(f"{where}: the data file {full(name)} changed since its "
                                 f"statistics were computed (size, mtime {dict(stamp)} -> "
                                 f"{dict(now[name])}); {rerun}")
    new = sorted(set(now) - set(stored))
    if new:
        raise ArrayDataError(f"{where}: file(s) {[str(full(n)) for n in new]} appeared since "
                             f"the statistics were computed; {rerun}")


def _channel_label(c: int, names: Sequence[str] | None, per_channel: bool) -> str:
    if not per_channel:
        return "(no channel axis)"
    if names is not None and c < len(names):
        return f"channel {c} ('{names[c]}')"
    return f"channel {c}"


def compute_statistics(source: Any, split: str) -> tuple[Path, dict[str, Any]]:
    """In one process: the statistics of `source` (an ArraySource: `statistics_plan()`,
    `path`, `where`; optionally `channel_names()`: {dataset: names}, for errors) stored
    beside its data; (the file, the merged statistics)."""
    plan = source.statistics_plan()
    stamp = data_fingerprint(source.path, source.where)
    part = partial_statistics(source.path, plan, where=source.where)
    merged = merge_statistics([part])
    names = source.channel_names() if hasattr(source, "channel_names") else None
    return write_statistics(source.path, merged, split=split, fingerprint=stamp,
                            where=source.where, channel_names=names), merged
