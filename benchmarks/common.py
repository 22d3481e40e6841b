"""Shared utilities for the benchmarks: interleaved repetitions, robust statistics, and the
record a run keeps.

Nothing here imports JAX at module level, so a benchmark can set `JAX_PLATFORMS` /
`JAX_NUM_CPU_DEVICES` / `XLA_FLAGS` after importing this module and before JAX starts.

Records: a benchmark run with `--record [VARIANT]` keeps its JSON document, wrapped with the
date, the command, the machine and the versions, as
`benchmarks/results/<benchmark>[-VARIANT].json`. The docs' tables and pictures are made from
those files only (`python benchmarks/report.py`), so a figure in the docs always has its
record, and a new record replaces the figures it measured once the report is regenerated.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "xarray",
             "netCDF4", "h5py", "zarr")


@dataclass(frozen=True)
class Stats:
    """Robust summary of repeated measurements (seconds or any unit)."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        v = sorted(values)
        if len(v) == 1:
            return cls(v[0], v[0], v[0], v[0], v[0], 1)
        q = statistics.quantiles(v, n=4, method="inclusive")
        return cls(statistics.median(v), q[0], q[2], v[0], v[-1], len(v))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def scaled(self, factor: float) -> Stats:
        return Stats(self.median * factor, self.q1 * factor, self.q3 * factor,
                     self.min * factor, self.max * factor, self.n)

    def as_dict(self, digits: int = 6) -> dict[str, float | int]:
        return {"median": round(self.median, digits), "q1": round(self.q1, digits),
                "q3": round(self.q3, digits), "min": round(self.min, digits),
                "max": round(self.max, digits), "n": self.n}


def interleaved(runners: Mapping[str, Callable[[], None]], reps: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Time each runner `reps` times, interleaved (AB, BA, AB, ...), after `warmup` rounds.

    A runner does a fixed amount of work and returns only when it is finished (the
    caller blocks on device results inside it). Alternating the order within each
    round cancels a linear drift (thermal, a neighbour's load) between the runners.
    Returns wall-clock seconds per repetition for each runner.
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median (order statistics)."""
    v = sorted(values)
    n = len(v)
    k = int((n - z * n ** 0.5) / 2)
    if n < 6 or k < 0:
        return v[0], v[-1]
    return v[k], v[n - 1 - k]


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a_i / b_i for repetitions taken in the same round (robust to slow drift)."""
    return [x / y for x, y in zip(a, b)]


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def machine() -> dict[str, str | int]:
    """Where a measurement came from (CPU model, cores, load, versions)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    info: dict[str, str | int] = {
        "cpu": cpu, "cores": os.cpu_count() or 0, "loadavg_1m": f"{load:.2f}",
        "python": platform.python_version(),
    }
    try:
        import jax
        import jaxlib

        info["jax"] = jax.__version__
        info["jaxlib"] = jaxlib.__version__
        info["backend"] = jax.default_backend()
        info["device"] = jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def table(rows: Sequence[Sequence[str]]) -> str:
    """A plain left-aligned text table; the first row is the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def json_line(record: Mapping) -> str:
    """One JSON object on one line (what CI and docs scrape)."""
    return json.dumps(record, sort_keys=False, default=str)


def versions() -> dict[str, str]:
    """The installed versions of the packages a figure depends on (absent ones left out),
    and of the C libraries under h5py and netCDF4 where the benchmark imported them (this
    imports nothing itself: gpu_check's parent never starts JAX)."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "h5py" in sys.modules:
        found["hdf5"] = sys.modules["h5py"].version.hdf5_version
    if "netCDF4" in sys.modules:
        found["netcdf_c"] = sys.modules["netCDF4"].__netcdf4libversion__
    return found


def add_record_option(parser: argparse.ArgumentParser) -> None:
    """`--record [VARIANT]`: keep this run's record under benchmarks/results/ (module doc)."""
    parser.add_argument(
        "--record", nargs="?", const="", default=None, metavar="VARIANT",
        help="also keep this run's record as benchmarks/results/<benchmark>[-VARIANT].json, "
             "from which `python benchmarks/report.py` makes the docs' tables and pictures")


def write_record(document: Mapping, variant: str = "", argv: Sequence[str] | None = None,
                 results: Path = RESULTS, machine_info: Mapping | None = None) -> Path:
    """Keep `document` (a benchmark's JSON line) as its record; returns the file written.
    `machine_info` stands in for `machine()` where this process must not start JAX."""
    name = str(document["benchmark"])
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path(name)
    try:
        script_text = str(script.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        script_text = str(script)
    record = {
        "benchmark": name, "variant": variant or None,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in ["python", script_text, *argv[1:]]),
        "machine": dict(machine() if machine_info is None else machine_info),
        "versions": versions(), "figures": dict(document),
    }
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}{'-' + variant if variant else ''}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"record kept: {path}")
    return path


def emit(document: Mapping, args: argparse.Namespace | None = None) -> None:
    """Print the benchmark's JSON line, and keep it as a record when `--record` was given."""
    print(json_line(document))
    variant = getattr(args, "record", None)
    if variant is not None:
        write_record(document, variant)
