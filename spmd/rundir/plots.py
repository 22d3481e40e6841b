"""PNG curves of a run (loss, test error, throughput); the task draws its own figures.

Reads RUN_DIR/metrics.jsonl (train records have `loss`; evaluation records have
`eval_loss` and/or other `eval_*`/`test_*` keys) and writes RUN_DIR/plots/*.png. The
task's `plot(out_dir, sample)` draws from RUN_DIR/eval_sample.npz (written at each
evaluation; `spmd.tasks.figures.plot_fields` draws 2-D or 3-D fields).
A resumed run may log a step twice: the last record of each step wins. `step` counts
updates done (spmd.loop.hooks).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spmd.errors import SpmdError

EVAL_PREFIXES = ("eval_", "test_")


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of metrics.jsonl, one per step, sorted by step."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise SpmdError(f"{run_dir}: no such run directory (the run.dir of a run)")
    if not path.is_file():
        raise SpmdError(f"{path}: no metrics; is {run_dir} a run directory that has trained "
                        f"at least run.log_every steps?")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(record, dict) or "step" not in record:
            raise SpmdError(f"{path}:{n}: not a metrics record (no 'step')")
        if any(k.startswith(EVAL_PREFIXES) for k in record):
            evals[int(record["step"])] = record
        elif "loss" in record:
            train[int(record["step"])] = record
    if not train and not evals:
        raise SpmdError(f"{path}: no metrics records yet")
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r[key]) for r in records
             if isinstance(r.get(key), int | float) and np.isfinite(r[key])]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps), np.asarray(values, dtype=float)


def _figure(title: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _positive(values: np.ndarray) -> bool:
    return values.size > 0 and bool(np.all(values > 0))


def plot_loss(train: list[dict], evals: list[dict], out: Path) -> Path | None:
    steps, loss = _series(train, "loss")
    e_steps, e_loss = _series(evals, "eval_loss")
    if not steps.size and not e_steps.size:
        return None
    fig, ax = _figure("Loss", "loss")
    if steps.size:
        ax.plot(steps, loss, label="train", lw=1.4)
    if e_steps.size:
        ax.plot(e_steps, e_loss, "o-", label="eval", lw=1.4, ms=4)
    if _positive(np.concatenate([loss, e_loss])):
        ax.set_yscale("log")
    ax.legend()
    return _save(fig, out / "loss.png")


def plot_eval(evals: list[dict], out: Path) -> Path | None:
    """Test error (test_rel_l2 and other eval metrics except eval_loss) against step."""
    keys = sorted({k for r in evals for k in r
                   if k.startswith(EVAL_PREFIXES) and k != "eval_loss"})
    if not keys:
        return None
    fig, ax = _figure("Test error", "error")
    values_all = []
    for key in keys:
        steps, values = _series(evals, key)
        if steps.size:
            ax.plot(steps, values, "o-", label=key, lw=1.4, ms=4)
            values_all.append(values)
            ax.annotate(f"{values[-1]:.4g}", (steps[-1], values[-1]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8)
    if values_all and _positive(np.concatenate(values_all)):
        ax.set_yscale("log")
    ax.legend()
    return _save(fig, out / "test_error.png")


def plot_throughput(train: list[dict], out: Path) -> Path | None:
    steps, rate = _series(train, "samples_per_s")
    if not steps.size:
        return None
    fig, ax = _figure("Throughput", "samples / s")
    ax.plot(steps, rate, lw=1.4, label="samples/s")
    ax.set_ylim(bottom=0)
    t_steps, tokens = _series(train, "tokens_per_s")
    if t_steps.size:
        twin = ax.twinx()
        twin.plot(t_steps, tokens, lw=1.0, color="tab:orange", label="tokens/s")
        twin.set_ylabel("tokens / s")
        twin.set_ylim(bottom=0)
    median = float(np.median(rate))
    ax.axhline(median, color="gray", ls="--", lw=0.8)
    ax.text(0.01, 0.03, f"median {median:,.1f} samples/s", transform=ax.transAxes, fontsize=8)
    return _save(fig, out / "throughput.png")


def read_sample(run_dir: Path) -> dict[str, np.ndarray] | None:
    """The arrays of RUN_DIR/eval_sample.npz (the last evaluation's), or None."""
    npz = run_dir / "eval_sample.npz"
    if not npz.is_file():
        return None
    with np.load(npz) as data:
        return {k: np.asarray(data[k]) for k in data.files}


def make_plots(run_dir: Path, task=None) -> list[Path]:
    """The generic curves, and the task's own figures of the last eval sample (if any)."""
    import matplotlib

    matplotlib.use("Agg")
    train, evals = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    made = [plot_loss(train, evals, out), plot_eval(evals, out), plot_throughput(train, out)]
    sample = read_sample(run_dir)
    if task is not None and sample is not None:
        made += list(task.plot(out, sample) or [])
    return [Path(p) for p in made if p is not None]
