"""The `data:` section (and its `data.window:`): where a task's examples come from, how the
train split is ordered and how batches are read ahead.

It lives here, next to the sources and the feed that build from it (docs/data.md), and
imports nothing of spmd (pydantic only); `spmd.config` assembles it into the run's `Config`.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class WindowConfig(BaseModel):
    """data.window: examples are time windows of stored trajectories (a dataset
    `[trajectory, time, ...]`, or `[time, ...]`: one trajectory per file); a window never
    crosses from one trajectory into the next (spmd.data.sources.windows, spmd.TrajectoryTask)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_steps: int = Field(1, ge=1, description="Frames in (the input of one example).")
    target_steps: int = Field(
        1, ge=1, description="Frames after the input that are the target.")
    stride: int = Field(1, ge=1, description="A window starts every `stride` time steps.")


# a date as a config writes it, in any calendar: 2019, 2019-03, 2019-02-30, 2019-03-24T06,
# ...T06:30, ...T06:30:15 (spmd.data.cf.calendars reads it in the data's calendar)
DATE = re.compile(r"^(\d{4})(?:-(\d{1,2})(?:-(\d{1,2})(?:[T ](\d{1,2})(?::(\d{2})"
                  r"(?::(\d{2}))?)?)?)?)?$")


def _config_time(value: Any) -> str | None:
    """A split's start or end as an ISO string: a YAML date (2002-01-01), a YAML timestamp
    (2002-01-01T06:00:00 or 2002-01-01 06:00:00, which YAML reads as a datetime; one with a
    zone is taken in UTC), a year (2010) or a string read as a time (2002-01-01T06:00; a
    date of any calendar, such as 2019-02-30, is checked against the data's calendar)."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.UTC).replace(tzinfo=None)
        return value.isoformat()
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9999:
        return f"{value:04d}"                    # a year, as YAML reads `start: 2010`
    if isinstance(value, str):
        try:
            np.datetime64(value.strip().replace(" ", "T"), "us")
            return value.strip()
        except ValueError:
            pass
        m = DATE.match(value.strip())     # a date only some calendars have (2019-02-30)
        if m and all(1 <= int(g or 1) <= top for g, top in zip(m.groups()[1:3], (12, 31))):
            return value.strip()
    raise ValueError(f"{value!r} is not a date or time; write e.g. 2002-01-01 or "
                     f"2002-01-01T06:00 (a date of the data's calendar)")


ConfigTime = Annotated[str | None, BeforeValidator(_config_time)]


class TimeRange(BaseModel):
    """data.splits.<split>: a time range of the data (both ends included; left out: the
    start or the end of the data); dates as 2002-01-01 or 2002-01-01T06:00."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: ConfigTime = Field(
        None, description="First time of the split (a window's times all lie in the range).")
    end: ConfigTime = Field(None, description="Last time of the split.")


class DataConfig(BaseModel):
    """data: the task's data set, the train order and the background reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["synthetic", "hdf5", "netcdf", "zarr", "npy"] = Field(
        "synthetic", description="`synthetic` (a pure function of seed, step and row) or array "
        "files: hdf5, netcdf (NetCDF4), zarr (v3), npy; the reader detects each file's format.")
    path: Path | None = Field(
        None, description="A store (file, Zarr store, directory of .npy), a directory of stores "
        "or a glob of them, concatenated along the first axis in sorted path order and indexed "
        "once beside the data (docs/data.md). Made by `spmd data make` if missing (one file).")
    fields: dict[str, str] = Field(
        default_factory=dict, description="Batch field -> dataset path in data.path "
        "(`{split}` stands for train / test); fields not named here take the task's default "
        "path (spmd.data.ArraySource).")
    num_train: int = Field(1000, ge=1, description="Examples in the train split.")
    num_test: int = Field(100, ge=1, description="Examples in the test split.")
    eval_batches: int = Field(
        2, ge=1, description="Batches of the test split each evaluation during training "
        "scores at most (its first windows, each once; `spmd eval` scores the whole split).")
    seed: int = Field(
        0, ge=0, description="Generator seed of a data set made by `spmd data make`.")
    solver: dict[str, Any] = Field(
        default_factory=dict, description="The task's own settings for making its data set "
        "(the FNO's PDE solver).")
    prefetch: int = Field(
        2, ge=0, description="Background reads: the batches of the next `prefetch` steps are "
        "read while a step runs (0: read when the step needs it). Batches are identical.")
    read_threads: int = Field(
        1, ge=1, description="Threads for the background reads. One is fastest for HDF5 (h5py "
        "serializes calls) and Zarr (a call's chunks are read concurrently); more help .npy "
        "memory maps on a slow file system.")
    shuffle_block: Annotated[int, Field(ge=1)] | Literal["auto", "full"] | None = Field(
        "auto", description="The train split's order (docs/data.md): the split is cut into "
        "blocks of this many consecutive records, visited in a shuffled order `shuffle_mix` "
        "blocks at a time, their records shuffled together, and each block read whole by the "
        "readahead (long reads on a cold cache or a parallel file system). auto: blocks of "
        "about 4 MiB of records (records of 4 MiB or more: full); full (or null): no blocks, a "
        "full shuffle of the split every epoch (grain's). Changing it changes the order, as "
        "the seed does; a resumed run keeps its own order unless it is set.")
    shuffle_mix: int = Field(
        16, ge=1, description="Blocks read at a time whose records are shuffled together (a "
        "batch draws from about this many places of the split).")
    window: WindowConfig | None = Field(
        None, description="Trajectory windows instead of stored (input, target) pairs; null: "
        "stored examples.")
    normalize: bool = Field(
        False, description="Train on fields normalized per channel ((x - mean) / std) with the "
        "statistics `spmd data stats CONFIG` stored beside the data; metrics and predictions "
        "stay in physical units. Tasks that support it: FieldTask and its subclasses "
        "(spmd.data.stats.normalization).")
    allow_changed: bool = Field(
        False, description="Each job of a run fingerprints every file of data.path (size, "
        "mtime and a hash of its first and last blocks; spmd.data.stats.run_inputs) and records "
        "it in run.dir; a resumed job whose files changed, disappeared or appeared is an error "
        "naming the file. true: train on with the new data, logged as a change of data "
        "(a warning).")
    variables: list[str | dict[str, list[float]]] | None = Field(
        None, description="Gridded weather / climate files (NetCDF4, Zarr; CF-decoded as xarray "
        "does): the variables stacked as the channels of a frame, in this order, e.g. [t2m, "
        "u10, {geopotential: [500, 850]}] (levels of a level dimension); null: data.fields "
        "names stored arrays (docs/data.md, Weather and climate files).")
    constants: list[str] = Field(
        default_factory=list, description="With data.variables: time-free extra input "
        "channels, e.g. [lsm, orography, latitude, longitude] (a variable of latitude and "
        "longitude in the first file, or the coordinate itself).")
    splits: dict[str, TimeRange] | None = Field(
        None, description="With data.variables: each split ({train, test}) is a time range "
        "{start, end} of the same files; required there (the test split is never the train "
        "split by default).")
    allow_split_overlap: bool = Field(
        False, description="Let data.splits ranges overlap (identical ranges stay an error).")
    time_gaps: Literal["error", "allow"] = Field(
        "error", description="With data.variables: a gap in the time axis (a jump of several "
        "steps) is an error naming the file and time (error), or cuts the timeline so that no "
        "window spans it (allow).")
    latitude_order: Literal["as_stored", "north_to_south", "south_to_north"] = Field(
        "as_stored", description="With data.variables: as_stored refuses a file whose "
        "latitude runs the other way from the first file's; north_to_south / south_to_north "
        "flips every file that differs on read.")
    nan: Literal["error", "mask", "fill"] = Field(
        "error", description="With data.variables: a NaN (a _FillValue, land in an ocean "
        "field) in a window is an error naming file, variable and time index (error); is "
        "replaced by data.nan_fill (fill); or is replaced and the task gets a mask field, 1 "
        "where valid, that its loss weights with (mask).")
    nan_fill: float = Field(0.0, description="The value NaNs become with data.nan: fill or mask.")


@dataclass(frozen=True)
class SourceSections:
    """What a data source reads of a run's config, and nothing else: the `data:` section
    and, of `train:`, the batch size, the seed of the train order and the number of steps
    (how far the train split reads ahead). `task` names the task in a source's errors.

    `Config.source_sections()` builds it, in one place, as `Config.engine_sections()` builds
    the engine's: the batch size reaches the sources by this route only. A test or a tool
    without a run config builds one by hand."""

    data: DataConfig
    batch_size: int
    seed: int = 0
    steps: int = 1
    task: str = "(unnamed)"
