"""Figures a task draws of its own eval samples (`Task.plot`), e.g. 2-D or 3-D fields.

The run directory's generic curves live in `spmd.rundir.plots`; these helpers draw what only
a task knows how to show. matplotlib loads on first use; the backend is the caller's
(`spmd.rundir.plots.make_plots` picks Agg).
"""

from __future__ import annotations

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
