"""Figures a task draws of its own eval samples (`Task.plot`), e.g. 2-D or 3-D fields.

The run directory's generic curves live in `spmd.rundir.plots`; these helpers draw what only
a task knows how to show. matplotlib loads on first use; the backend is the caller's
(`spmd.rundir.plots.make_plots` picks Agg).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SAMPLE_ORDER = ("input", "truth", "prediction", "error")


def plot_fields(fields: dict[str, np.ndarray], path: Path,
                title: str = "Test samples at the last evaluation") -> Path | None:
    """One row per sample, one column per field (input, truth, prediction, error).

    Fields are (sample, x, y) or (sample, x, y, channel); a 3-D field (sample, x, y, z)
    shows its middle z slice.
    """
    import matplotlib.pyplot as plt

    names = [k for k in SAMPLE_ORDER if k in fields] + sorted(
        k for k in fields if k not in SAMPLE_ORDER)
    names = [k for k in names if fields[k].ndim in (3, 4)]
    if not names:
        return None
    rows = min(min(fields[k].shape[0] for k in names), 4)
    fig, axes = plt.subplots(rows, len(names), figsize=(3.0 * len(names), 2.7 * rows), dpi=100,
                             squeeze=False)
    for j, name in enumerate(names):
        values = fields[name][:rows]
        if values.ndim == 4:  # a channel, or the middle slice of a volume
            values = values[..., 0] if values.shape[-1] <= 4 else values[..., values.shape[-1] // 2]
        if name == "error":
            bound = float(np.max(np.abs(values))) or 1.0
            kw = {"cmap": "RdBu_r", "vmin": -bound, "vmax": bound}
        elif name in ("truth", "prediction") and "truth" in fields:
            ref = np.concatenate([fields[k][:rows].ravel() for k in ("truth", "prediction")
                                  if k in fields])
            kw = {"cmap": "viridis", "vmin": float(ref.min()), "vmax": float(ref.max())}
        else:
            kw = {"cmap": "viridis"}
        for i in range(rows):
            ax = axes[i, j]
            image = ax.imshow(values[i].T, origin="lower", extent=(0, 1, 0, 1), **kw)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(name)
            if name == "error" and "truth" in fields:
                truth = fields["truth"][i]
                rel = np.linalg.norm(values[i]) / max(float(np.linalg.norm(truth)), 1e-30)
                ax.set_xlabel(f"rel. L2 {rel:.3g}", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _last_record(metrics: Path, wanted) -> dict | None:
    """The last record of a run's metrics.jsonl for which `wanted(record)` is true, or None
    (no such record, or no file). A line cut by a kill is skipped."""
    found = None
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if wanted(record):
                    found = record
    except OSError:
        return None
    return found


def last_rollout_errors(metrics: Path, keys: list[str]) -> tuple[int, np.ndarray] | None:
    """(step, the values of `keys`: the mean relative L2 error per lead) of the last
    evaluation in a run's metrics.jsonl that has them all (over every eval batch), or None
    when it holds none."""
    found = _last_record(metrics, lambda r: all(k in r for k in keys))
    if found is None:
        return None
    return int(found["step"]), np.asarray([found[k] for k in keys])


def plot_rollout_error(lead_error: np.ndarray, path: Path, dt: float | None = None,
                       overall: tuple[int, np.ndarray] | None = None) -> Path:
    """Relative L2 error against lead time: the evaluation's mean over every test window
    (`overall`: step and errors per lead, from metrics.jsonl) in bold, the sampled examples
    (batch, leads) thin with their mean; model steps below, physical time above when `dt`
    is given."""
    import matplotlib.pyplot as plt

    leads = np.arange(1, lead_error.shape[1] + 1)
    fig, ax = plt.subplots(figsize=(6.5, 4.0), dpi=110)
    for row in lead_error:
        ax.plot(leads, row, color="tab:blue", alpha=0.25, lw=0.8)
    mean = lead_error.mean(axis=0)
    ax.plot(leads, mean, "o--", color="tab:blue", lw=1.0, ms=3,
            label=f"mean of {lead_error.shape[0]} sampled test windows")
    if overall is not None and len(overall[1]) == len(leads):
        mean = overall[1]
        ax.plot(leads, mean, "o-", color="black", lw=1.8, ms=4,
                label=f"all test windows (evaluation at step {overall[0]})")
    ax.annotate(f"{mean[-1]:.3g}", (leads[-1], mean[-1]), textcoords="offset points",
                xytext=(-8, 6), fontsize=8)
    ax.set_xlabel("lead (model steps)")
    ax.set_ylabel("relative L2 error")
    ax.set_xticks(leads if len(leads) <= 16 else leads[:: len(leads) // 8])
    ax.set_ylim(0, 1.12 * max(float(mean.max()), float(lead_error.max())) or 1.0)
    ax.grid(True, alpha=0.3)
    if dt:
        top = ax.secondary_xaxis("top", functions=(lambda k: k * dt, lambda t: t / dt))
        top.set_xlabel("lead time")
    ax.set_title("Rollout error against lead time")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# metrics.jsonl prefix -> (kind, is a mean squared error); longest prefixes first
WEATHER_KEYS = (("persistence_lat_mse_", "persistence", True),
                ("climatology_lat_mse_", "climatology", True),
                ("lat_mse_", "model", True),
                ("persistence_acc_", "persistence_acc", False),
                ("acc_", "acc", False))
RMSE_LINES = (("model", "o-"), ("persistence", "s--"), ("climatology", "^:"))
ACC_LINES = (("acc", "model", "o-"), ("persistence_acc", "persistence", "s--"))


def last_weather_scores(metrics: Path) -> tuple[int, dict[str, dict[str, np.ndarray]]] | None:
    """(step, {channel: {kind: values per lead}}) of the last evaluation in a run's
    metrics.jsonl that holds latitude-weighted scores (spmd.scores.weather), or None when
    none does. Kinds: "model", "persistence", "climatology" (RMSE: the square roots of the
    means of `lat_mse_*`, `persistence_lat_mse_*`, `climatology_lat_mse_*`) and "acc",
    "persistence_acc" (ACC, `acc_*`, `persistence_acc_*`), those present."""
    found = _last_record(metrics, lambda r: any(k.startswith("lat_mse_") for k in r))
    if found is None:
        return None
    table: dict[str, dict[str, dict[int, float]]] = {}
    squared = {kind: sq for _, kind, sq in WEATHER_KEYS}
    for key, value in found.items():
        for prefix, kind, _ in WEATHER_KEYS:
            if key.startswith(prefix):
                channel, _, lead = key[len(prefix):].rpartition("_")
                if channel and lead.isdigit():
                    table.setdefault(channel, {}).setdefault(kind, {})[int(lead)] = float(value)
                break
    out = {c: {kind: (np.sqrt if squared[kind] else np.asarray)([v[k] for k in sorted(v)])
               for kind, v in kinds.items()}
           for c, kinds in table.items()}
    return int(found.get("step", -1)), out


def plot_weather_rmse(step: int, scores: dict[str, dict[str, np.ndarray]], path: Path,
                      dt: float | None = None) -> Path:
    """Latitude-weighted scores against lead, from `last_weather_scores`: per channel a
    panel of RMSE (the model solid, persistence dashed, the climatology dotted) and, when
    the evaluation has ACC, a panel of ACC below it (the model and persistence)."""
    import matplotlib.pyplot as plt

    names = list(scores)
    with_acc = any("acc" in kinds for kinds in scores.values())
    cols = min(len(names), 3)
    grid_rows = -(-len(names) // cols)
    per = 2 if with_acc else 1                  # panel rows per channel
    fig, axes = plt.subplots(grid_rows * per, cols, figsize=(4.0 * cols, 3.0 * grid_rows * per),
                             dpi=100, squeeze=False)
    for ax in axes.ravel():
        ax.set_visible(False)
    for i, name in enumerate(names):
        r, col = divmod(i, cols)
        panels = [(axes[r * per, col], [(kind, kind, style) for kind, style in RMSE_LINES],
                   "lat-weighted RMSE")]
        if with_acc:
            panels.append((axes[r * per + 1, col], ACC_LINES, "lat-weighted ACC"))
        for ax, lines, label in panels:
            ax.set_visible(True)
            for kind, legend, style in lines:
                values = scores[name].get(kind)
                if values is not None:
                    leads = np.arange(1, len(values) + 1)
                    ax.plot(leads * dt if dt else leads, values, style, ms=3, label=legend)
            ax.set_title(f"{name}: {label.split()[-1]}")
            ax.set_xlabel("lead time" if dt else "lead (model steps)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    title = "Latitude-weighted RMSE" + (" and ACC" if with_acc else "")
    fig.suptitle(f"{title} against the baselines (evaluation at step {step})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
