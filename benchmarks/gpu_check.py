"""Every GPU figure from one command, in at most 7 minutes on one H100 (issue 39).

    python benchmarks/gpu_check.py --out DIR               # on one GPU node
    python benchmarks/gpu_check.py --out DIR --cpu-smoke   # every part, tiny, on CPU (CI)

Writes DIR/gpu_check.json and DIR/gpu_check.md (and each part's log, DIR/<part>.log). The
parts, in this order, each in a child process of its own (a crash, a hang or an
out-of-memory stays in its part; this process never imports JAX, so it holds no GPU memory):

1. `devices`: jax.devices(), the versions, the XLA flags and environment in use;
2. `main_job`: the README main job (configs/fno_darcy.yaml) on one device, one process:
   samples/s and the test error;
3. `mfu_1.3b`, `mfu_3.3b-w4096`: benchmarks/gpu_mfu.py --compare: MFU, the spmd step against
   the plain-JAX step of the same run, the compile time, the peak memory against
   `spmd plan`'s prediction of the same compiled step;
4. `remat_2.7b`: the 2.7b model with remat (model.remat=dots): whether it fits, its MFU;
5. `checkpoint`: a 9 GiB state, the local tier's async save in the `auto`, `pinned` and
   `device` snapshot modes against Orbax's own async save of it in the same process
   (blocking seconds, and until written), and a cold-ish restore from the local tier;
6. `features`: a training run with model.attention=cudnn, one with
   checkpoint.snapshot=pinned, and `spmd plan --system perlmutter-80g`, each pass or fail.

Time: a budget (`--budget-s`, 420 s on a GPU) is shared out (SHARES); a part may use its
share plus what the parts before it left unused, and is skipped, with the reason, when the
parts before it have used up its share (less than half of it, or MIN_PART_S, is left). A
failing part never stops the others: its error (the tail of its output) goes into the JSON.
`--cpu-smoke` runs the same parts through the same code at tiny sizes on CPU (attention
`xla`: cuDNN is NVIDIA's; a backend without pinned host memory takes `host` for `pinned`,
as spmd always does) and writes the same keys.

Installing on a GPU node whose image lacks pydantic, grain or the mpich wheel:
benchmarks/gpu_wheels.sh (docs/performance.md, "The GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import add_record_option, write_record  # noqa: E402  (imports no JAX)

GPU_BUDGET_S = 420.0
SMOKE_BUDGET_S = 600.0
MIN_PART_S = 10.0
# each part's share of the budget (sums to 1)
SHARES = {"devices": 0.03, "main_job": 0.15, "mfu_1.3b": 0.15, "mfu_3.3b-w4096": 0.15,
          "remat_2.7b": 0.12, "checkpoint": 0.22, "features": 0.18}
PARTS = tuple(SHARES)
PLAN_SYSTEM = "perlmutter-80g"       # an NVIDIA profile of spmd.hpc.systems
CHECKPOINT_MODES = ("auto", "pinned", "device")
TARGETS = {"mfu": 0.50, "spmd_over_plain": 1.0, "local_over_orbax_blocking": 1.0,
           "plan_error": 0.10}


# ------------------------------------------------------------------ the child parts


def spmd_argv(*args: str) -> list[str]:
    """The spmd CLI of the importable spmd (no console script needed on the node)."""
    return [sys.executable, "-m", "spmd.cli", *args]


def part_devices(smoke: bool, out: Path) -> dict:
    from importlib import metadata

    import jax

    sys.path.insert(0, str(HERE))
    from gpu_mfu import apply_gpu_settings

    flags, env = ([], {}) if smoke else apply_gpu_settings(None)
    versions = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "h5py",
                 "pydantic", "grain", "mpi4py", "tensorstore"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import spmd

    devices = jax.devices()
    return {"backend": jax.default_backend(), "devices": [str(d) for d in devices],
            "spmd": str(Path(spmd.__file__).parent),
            "device_kind": devices[0].device_kind, "device_count": len(devices),
            "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "gpu_flags_applied": flags, "env": {k: os.environ.get(k) for k in env}}


def partial_path(out: Path, part: str) -> Path:
    """Where a child part leaves what it has measured so far (read if it runs out of time)."""
    return out / f"{part}_partial.json"


def part_checkpoint(smoke: bool, out: Path) -> dict:
    """Local-tier async save in each snapshot mode against Orbax's own async save, and a
    restore from the local tier; the 9 GiB state (64 MiB in the smoke run)."""
    import shutil

    sys.path.insert(0, str(HERE))
    import checkpoint_bench as cb

    state, nbytes, where = cb.make_state(64 if smoke else 9 * 1024)
    abstract = cb._abstract(state)
    figures: dict = {"state_bytes": nbytes, "devices": where, "modes": {}}
    for mode in CHECKPOINT_MODES:
        root = out / "checkpoint_work" / mode
        shutil.rmtree(root, ignore_errors=True)
        ck = cb.checkpointer(root / "spmd", every=1, persistent_every=0, snapshot=mode,
                             **{"async": True})
        ck.restore(abstract)                      # start-up: layout, pinned buffers
        ck.maybe_save(1, state)                   # warm-up save (first pinned allocation)
        ck.wait()
        t0 = time.perf_counter()
        ck.maybe_save(2, state)
        blocking = time.perf_counter() - t0
        ck.wait()
        total = time.perf_counter() - t0
        cb.evict(root / "spmd")
        t1 = time.perf_counter()
        got = ck.restore(abstract)
        cb.jax_block(got.state)
        restore_s = time.perf_counter() - t1
        restored_step, source = got.step, got.source
        resolved = ck.snapshotter.mode
        del got
        ck.close()
        orbax = cb.OrbaxAsync(root / "orbax")
        if mode == CHECKPOINT_MODES[0]:           # Orbax's start-up, once
            fresh = cb._bump(state)
            cb.jax_block(fresh)
            orbax.save(1, fresh)
            orbax.wait()
        fresh = cb._bump(state)
        cb.jax_block(fresh)
        t2 = time.perf_counter()
        orbax_blocking = orbax.save(2, fresh)
        orbax.wait()
        orbax_total = time.perf_counter() - t2
        orbax.close()
        del fresh
        shutil.rmtree(root, ignore_errors=True)   # 9 GiB a mode: the node's disk is small
        figures["modes"][mode] = {
            "resolved_mode": resolved, "local_blocking_s": round(blocking, 4),
            "local_total_s": round(total, 3), "orbax_blocking_s": round(orbax_blocking, 4),
            "orbax_total_s": round(orbax_total, 3),
            "local_over_orbax_blocking": round(blocking / orbax_blocking, 3),
            "local_restore_s": round(restore_s, 3),
            "restored": [restored_step, source]}
        # what is done so far, for a part that runs out of time in a later mode
        partial_path(out, "checkpoint").write_text(json.dumps(figures, default=str))
    return figures


CHILD_PARTS = {"devices": part_devices, "checkpoint": part_checkpoint}


# ------------------------------------------------------------------ running a part


def run_child(argv: list[str], limit_s: float, log: Path) -> tuple[int | None, str]:
    """Run `argv` for at most `limit_s`, in the folder of `log` (not the checkout: there
    `python -m` would import the checkout's spmd/ before an installed one); (exit status or
    None when it ran out of time, its output). The output is also kept in `log`."""
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the checkout last: an installed spmd (gpu_wheels.sh's --target) must come first
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (child_env.get("PYTHONPATH", ""), str(REPO)) if p)
    try:
        proc = subprocess.run(argv, cwd=log.parent, env=child_env, capture_output=True, text=True,
                              timeout=max(1.0, limit_s))
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        def as_text(b) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        code, text = None, as_text(e.stdout) + as_text(e.stderr)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n{text}\n")
    return code, text


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def child_part(name: str, smoke: bool, out: Path, limit_s: float) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out)]
    partial = partial_path(out, name)
    partial.unlink(missing_ok=True)
    code, text = run_child(argv + (["--cpu-smoke"] if smoke else []), limit_s,
                           out / f"{name}.log")
    got = last_json(text)
    if code == 0 and got is not None:
        return {"status": "ok", "figures": got}
    return {**failed(code, text, limit_s),
            **({"figures": json.loads(partial.read_text())} if partial.is_file() else {})}


def failed(code: int | None, text: str, limit_s: float) -> dict:
    if code is None:
        return {"status": "timeout", "error": f"ran past its {limit_s:.0f} s\n{tail(text)}"}
    return {"status": "failed", "error": f"exit {code}\n{tail(text)}"}


# each gpu_mfu.py command run so far: the part that ran it, its exit status and output. With
# --cpu-smoke, mfu_1.3b and mfu_3.3b-w4096 are the same tiny command (their sizes differ on a
# GPU only): it runs once, and the second part says whose run it reports (`same_run_as`)
_MFU_RUNS: dict[tuple[str, ...], tuple[str, int | None, str]] = {}


def mfu_part(size: str, smoke: bool, out: Path, limit_s: float, name: str,
             extra: tuple[str, ...] = ("--compare",)) -> dict:
    argv = [sys.executable, str(HERE / "gpu_mfu.py"), *extra]
    argv += (["--short", "--size", "tiny"] if smoke
             else ["--size", size, "--steps", "5", "--reps", "3"])
    if tuple(argv) not in _MFU_RUNS:
        _MFU_RUNS[tuple(argv)] = (name, *run_child(argv, limit_s, out / f"{name}.log"))
    ran_in, code, text = _MFU_RUNS[tuple(argv)]
    same = {} if ran_in == name else {"same_run_as": ran_in}
    got = last_json(text)
    if code not in (0, 1) or got is None:      # 1: ran, below its MFU target
        return failed(code, text, limit_s)
    r = got["results"][0]
    keys = ("size", "params", "remat", "attention", "fits", "compile_s", "plain_compile_s",
            "mfu", "plain_mfu", "step_s", "plain_step_s", "ratio", "peak_bytes",
            "measured_peak_bytes", "plan_over_measured", "loss", "tokens_per_s",
            "model_flops_per_step")
    return {"status": "ok", **same, "figures": {"device_kind": got["device_kind"],
                                                 "xla_flags": got.get("xla_flags"),
                                                 **{k: r.get(k) for k in keys}}}


def main_job_part(smoke: bool, out: Path, limit_s: float) -> dict:
    from spmd.rundir.metrics import read_jsonl  # no JAX: this process holds no GPU memory

    run_dir = out / "main_job"
    keys = [f"run.dir={run_dir}", f"data.path={run_dir / 'darcy_g64.h5'}",
            "checkpoint.every=0", "checkpoint.persistent_every=0", "checkpoint.final=false",
            "run.plots=false"]
    if smoke:
        keys += ["train.steps=4", "train.eval_every=4", "run.log_every=1",
                 "data.num_train=32", "data.num_test=16", "data.eval_batches=1",
                 "model.width=8", "model.modes=4", "model.projection=16"]
    code, text = run_child(spmd_argv("train", str(REPO / "configs" / "fno_darcy.yaml"), *keys),
                           limit_s, out / "main_job.log")
    if code != 0:
        return failed(code, text, limit_s)
    records = read_jsonl(run_dir / "metrics.jsonl")
    # the first logged step holds the compile
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    evals = [r for r in records if "test_rel_l2" in r]
    return {"status": "ok", "figures": {
        "steps": max(r.get("step", 0) for r in records),
        "samples_per_s_median": statistics.median(rates) if rates else None,
        "test_rel_l2_first": evals[0]["test_rel_l2"] if evals else None,
        "test_rel_l2_last": evals[-1]["test_rel_l2"] if evals else None}}


def features_part(smoke: bool, out: Path, limit_s: float) -> dict:
    config = str(REPO / "configs" / "transformer_tiny.yaml")
    tiny = [config, "train.steps=4", "run.plots=false"]
    runs = {
        "attention_cudnn": spmd_argv("train", *tiny, f"run.dir={out / 'f_attention'}",
                                     "model.dtype=bfloat16",
                                     f"model.attention={'xla' if smoke else 'cudnn'}"),
        "snapshot_pinned": spmd_argv("train", *tiny, f"run.dir={out / 'f_pinned'}",
                                     "checkpoint.snapshot=pinned", "checkpoint.every=2"),
        "plan_system": spmd_argv("plan", config, "--devices", "4",
                                 "--system", PLAN_SYSTEM, "--json"),
    }
    weights = {"attention_cudnn": 0.4, "snapshot_pinned": 0.4, "plan_system": 0.2}
    began, figures = time.monotonic(), {}
    for i, (name, argv) in enumerate(runs.items()):
        left = limit_s - (time.monotonic() - began)
        share = weights[name] / sum(list(weights.values())[i:])   # of what is left
        code, text = run_child(argv, left * share, out / "features.log")
        figures[name] = ({"pass": True, "error": None} if code == 0 else
                         {"pass": False, "error": failed(code, text, left)["error"]})
    figures["variant"] = "cpu-smoke: attention xla (cuDNN is NVIDIA's)" if smoke else "gpu"
    ok = all(v["pass"] for k, v in figures.items() if isinstance(v, dict))
    return {"status": "ok" if ok else "failed", "figures": figures}


def run_part(name: str, smoke: bool, out: Path, limit_s: float) -> dict:
    if name in CHILD_PARTS:
        return child_part(name, smoke, out, limit_s)
    if name == "main_job":
        return main_job_part(smoke, out, limit_s)
    if name.startswith("mfu_"):
        return mfu_part(name[len("mfu_"):], smoke, out, limit_s, name)
    if name == "remat_2.7b":
        return mfu_part("2.7b", smoke, out, limit_s, name, ("--remat", "dots"))
    return features_part(smoke, out, limit_s)


# ------------------------------------------------------------------ the report


def verdicts(parts: dict) -> dict:
    """Each GPU target: the figure, and whether it holds (None where it was not measured)."""
    def fig(part: str) -> dict:
        return parts.get(part, {}).get("figures") or {}

    mfus = [fig(p).get("mfu") for p in ("mfu_1.3b", "mfu_3.3b-w4096", "remat_2.7b")]
    mfus = [m for m in mfus if m is not None]
    ratios = [(fig(p).get("ratio") or {}).get("median") for p in ("mfu_1.3b", "mfu_3.3b-w4096")]
    ratios = [r for r in ratios if r is not None]
    plans = [fig(p).get("plan_over_measured") for p in ("mfu_1.3b", "mfu_3.3b-w4096")]
    plans = [abs(p - 1) for p in plans if p]
    blocking = [m.get("local_over_orbax_blocking")
                for m in (fig("checkpoint").get("modes") or {}).values()]
    blocking = [b for b in blocking if b is not None]

    def one(value, holds):
        return {"value": value, "holds": None if value is None else holds(value)}

    return {
        "best_mfu >= 0.50": one(max(mfus) if mfus else None, lambda v: v >= TARGETS["mfu"]),
        "spmd / plain step <= 1.0": one(max(ratios) if ratios else None,
                                        lambda v: v <= TARGETS["spmd_over_plain"]),
        "2.7b fits": one(fig("remat_2.7b").get("fits"), bool),
        "local / Orbax blocking <= 1.0 (best mode)": one(
            min(blocking) if blocking else None,
            lambda v: v <= TARGETS["local_over_orbax_blocking"]),
        "plan peak within 10% of measured": one(max(plans) if plans else None,
                                                lambda v: v <= TARGETS["plan_error"]),
    }


def markdown(record: dict) -> str:
    d = (record["parts"].get("devices", {}).get("figures") or {})
    lines = [f"# GPU check ({record['mode']}), {record['finished']}", "",
             f"device: {d.get('device_kind')} x {d.get('device_count')} ({d.get('backend')}); "
             f"versions: {json.dumps(d.get('versions'))}", f"XLA_FLAGS: `{d.get('xla_flags')}`",
             f"command: `{record['command']}`", "",
             "| part | status | seconds (limit) | figures / error |", "|---|---|---|---|"]
    for name in PARTS:
        p = record["parts"][name]
        what = p.get("error") or p.get("reason") or json.dumps(p.get("figures"))
        what = what.replace("|", "\\|").replace("\n", "<br>")
        lines.append(f"| {name} | {p['status']} | {p.get('seconds', 0):.1f} "
                     f"({p.get('limit_s', 0):.0f}) | {what[:1500]} |")
    lines += ["", "| target | figure | holds |", "|---|---|---|"]
    for name, v in record["targets"].items():
        lines.append(f"| {name} | {v['value']} | {v['holds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the JSON and table go")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every part at tiny sizes on CPU, the same code and JSON keys")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds for all parts (default {GPU_BUDGET_S:.0f} on a GPU, "
                         f"{SMOKE_BUDGET_S:.0f} with --cpu-smoke)")
    ap.add_argument("--only", default=None, help="comma-separated parts (default: all)")
    ap.add_argument("--part", choices=tuple(CHILD_PARTS), help=argparse.SUPPRESS)
    add_record_option(ap)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.part:      # a child: one part in this process, its figures as the last line
        print(json.dumps(CHILD_PARTS[args.part](args.cpu_smoke, out), default=str))
        return 0
    budget = args.budget_s or (SMOKE_BUDGET_S if args.cpu_smoke else GPU_BUDGET_S)
    wanted = PARTS if not args.only else tuple(args.only.split(","))
    unknown = set(wanted) - set(PARTS)
    if unknown:
        ap.error(f"--only {','.join(sorted(unknown))}: parts are {', '.join(PARTS)}")
    began = time.monotonic()
    record: dict = {"benchmark": "gpu_check", "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
                    "budget_s": budget, "command": " ".join(["python", *sys.argv]),
                    "parts": {}}
    banked = 0.0
    for name in PARTS:
        left = budget - (time.monotonic() - began)
        share = SHARES[name] * budget
        if name not in wanted:
            record["parts"][name] = {"status": "skipped", "reason": "not in --only",
                                     "seconds": 0.0, "limit_s": 0.0}
            continue
        limit = min(share + banked, left)
        least = max(MIN_PART_S, 0.5 * share)
        if limit < least:
            record["parts"][name] = {
                "status": "skipped", "seconds": 0.0, "limit_s": 0.0,
                "reason": f"the parts before it used {budget - left:.0f} s of the {budget:.0f} "
                          f"s budget; {left:.0f} s left, under the {least:.0f} s it needs "
                          f"at least (half its share of {share:.0f} s, or {MIN_PART_S:.0f} s)"}
            continue
        t = time.monotonic()
        print(f"gpu_check: {name} (limit {limit:.0f} s) ...", flush=True)
        try:
            result = run_part(name, args.cpu_smoke, out, limit)
        except Exception as e:      # this process's own bug: the part fails, the rest runs
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        took = time.monotonic() - t
        banked = max(0.0, share + banked - took)
        record["parts"][name] = {**result, "seconds": round(took, 1), "limit_s": round(limit)}
        print(f"gpu_check: {name}: {result['status']} in {took:.1f} s", flush=True)
    record["targets"] = verdicts(record["parts"])
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    record["seconds"] = round(time.monotonic() - began, 1)
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(record))
    print(markdown(record))
    if args.record is not None:     # the devices part says where it ran: no JAX started here
        found = record["parts"]["devices"].get("figures", {})
        write_record(record, args.record, machine_info={
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count() or 0,
            "loadavg_1m": f"{os.getloadavg()[0]:.2f}", "python": platform.python_version(),
            "backend": found.get("backend", "?"), "device": found.get("device_kind", "?"),
            "device_count": found.get("device_count", "?")})
    return 0 if all(p["status"] in ("ok", "skipped") for p in record["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
