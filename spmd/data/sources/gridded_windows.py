"""Time windows of gridded weather / climate files as the examples of a batch
(`data.variables`, `data.splits`, `data.nan`; docs/data.md, Weather and climate files).

The data are files as they exist: yearly NetCDF4 files (ERA5's way) or one Zarr store
(WeatherBench2's), variables CF-encoded (packed, with fill values), dims in any order.
`spmd.data.cf.gridded_timeline` checks and orders the files into one timeline; this source cuts it
into windows of `input_steps + target_steps` consecutive times, stacked as channels.

Invariants:
- A frame is `(latitude, longitude, C)`: the channels of `data.variables` in the order
  written (spmd.data.cf.channels), latitude in the first file's order (or data.latitude_order).
  Values are decoded as xarray decodes them (spmd.data.cf.cf_decode), then cast to the
  field's dtype.
- Record `i` is the i-th window of the split in time order: windows start every `stride`
  steps within a segment of the timeline (no gap inside), with every time of the window in
  the split's range (data.splits.<split>). Windows cross file boundaries; never a gap.
- Layout "channels" (TrajectoryTask's): the input is `(lat, lon, input_steps * C + K)`,
  the frames in time order, then the K constants of data.constants; the target `(lat, lon,
  target_steps * C)`. With data.nan: mask, a mask field of the target's shape, 1.0 where the
  value is valid, 0.0 where it was NaN. With `standardize_constants` (data.normalize) each
  constant is (c - its grid mean) / its grid std, so that degrees of latitude do not
  dwarf normalized frames.
- Reads go by time blocks that follow the files' time chunks (a multiple of the chunk of
  about 8 MiB of frames, or 8 MiB of rows of an unchunked file), decoded once and kept in
  a small cache (`cache_bytes`): windows of neighbouring times (data.shuffle_block's
  blocks) are cut from blocks in memory. The files are read by spmd.data.reads.gridded_reads
  (NetCDF4 with h5py directly); a block is checked for NaN once, and
  a window of NaN-free blocks is copied frame by frame straight into the batch's pooled
  buffers (docs/performance.md, section 7, weather files).
- data.nan: error (default) raises on the first NaN of a window, one line naming the file,
  the variable (and level), the time index in the file and its time; fill replaces NaN by
  data.nan_fill; mask does too and hands the mask field.
- The record order is ArraySource's (seeded block shuffle, a pure function of seed, step
  and row); `rows` is thread safe; the source pickles without its open files.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.batch import BatchField
from spmd.data.cf.calendars import AXIS
from spmd.data.cf.cf_decode import decode
from spmd.data.cf.channels import Channel, channel_table, parse_channels
from spmd.data.cf.gridded_timeline import Timeline, build_timeline
from spmd.data.cf.time_splits import as_time, require_split, split_range
from spmd.data.data_config import SourceSections
from spmd.data.formats.stores import ArrayDataError
from spmd.data.reads.gridded_reads import GriddedReader
from spmd.data.sources.arrays import ArraySource, Region
from spmd.data.sources.forecast_grid import ForecastGrid, forecast_grid
from spmd.data.stats.normalization import Moments

__all__ = ["GriddedWindowSource", "NAN_POLICIES"]

NAN_POLICIES = ("error", "mask", "fill")
BLOCK_BYTES = 8 << 20                    # a read block: about this many bytes of frames
#                                          (8 MiB: 256 steps of 4 x 32 x 64; 4 MiB read
#                                          chunked files measurably slower, issue 35)
MAX_BLOCK_BYTES = 64 << 20               # ... and never more (part of a longer chunk)


class GriddedWindowSource(ArraySource):
    """Windows of `channels` over the timeline of the files at `path`, in the time range
    `time_range` (start, end; None: open; axis times or dates of the data's calendar), or
    split `split` of `splits` (data.splits, read in the data's calendar), as rows of
    `input_name` and `target_name`
    (and `mask_name` when given); `constants` (data.constants) are appended to the input's
    channels. See the module docstring."""

    reads_slabs = False

    def __init__(self, path: str | Path, channels: Sequence[Channel],
                 fields: Mapping[str, BatchField], batch_size: int, *, input_name: str,
                 target_name: str, mask_name: str | None = None, constants: Sequence[str] = (),
                 input_steps: int = 1, target_steps: int = 1, stride: int = 1,
                 time_range: tuple[Any, Any] = (None, None), split: str = "train",
                 splits: Mapping[str, Any] | None = None, allow_split_overlap: bool = False,
                 time_gaps: str = "error", latitude_order: str = "as_stored",
                 nan: str = "error", nan_fill: float | Sequence[float] = 0.0,
                 standardize_constants: bool = False, seed: int = 0,
                 shuffle: bool = True, count: int | None = None,
                 config_key: str = "data.path", window_key: str = "data.window",
                 prefetch: int = 0, read_threads: int = 1,
                 prefetch_until: int | None = None, max_open: int = 64,
                 shuffle_block: int | str | None = "auto", shuffle_mix: int = 16,
                 cache_bytes: int = 256 << 20):
        self.channels, self.constants = list(channels), list(constants)
        self.input_name, self.target_name = input_name, target_name
        self.mask_name = mask_name
        self.input_steps, self.target_steps = int(input_steps), int(target_steps)
        self.stride, self.span = int(stride), int(input_steps) + int(target_steps)
        self.time_range, self.split = tuple(time_range), split
        self.splits, self.allow_split_overlap = splits, bool(allow_split_overlap)
        self.time_gaps, self.latitude_order = time_gaps, latitude_order
        self.nan, self.window_key = nan, window_key
        self.nan_fill = np.asarray(nan_fill, np.float32)    # a value, or one per channel
        self.cache_bytes = int(cache_bytes)
        self.standardize_constants = bool(standardize_constants)
        for key, value in (("input_steps", input_steps), ("target_steps", target_steps),
                           ("stride", stride)):
            if int(value) < 1:
                raise ArrayDataError(f"{window_key}.{key}={value}: must be at least 1")
        if nan not in NAN_POLICIES:
            raise ArrayDataError(f"data.nan={nan}: one of {list(NAN_POLICIES)}")
        wanted = {input_name, target_name} | ({mask_name} if mask_name else set())
        if set(fields) != wanted:
            raise ValueError(f"GriddedWindowSource: fields {sorted(fields)} must be exactly "
                             f"{sorted(wanted)}")
        if mask_name and nan != "mask":
            raise ValueError("GriddedWindowSource: a mask field needs nan='mask'")
        first = self.channels[0].variable if self.channels else "?"
        super().__init__(path, {name: first for name in fields}, fields, batch_size,
                         seed=seed, shuffle=shuffle, count=count, config_key=config_key,
                         fields_key="data.variables", prefetch=prefetch,
                         read_threads=read_threads, prefetch_until=prefetch_until,
                         max_open=max_open, shuffle_block=shuffle_block,
                         shuffle_mix=shuffle_mix)

    @classmethod
    def from_sections(cls, sections: SourceSections, split: str,
                      fields: Mapping[str, BatchField], *, input_name: str, target_name: str,
                      mask_name: str | None = None, shuffle: bool,
                      target_steps: int | None = None, count: int | None = None,
                      nan_fill: Sequence[float] | None = None,
                      config_key: str = "data.path") -> GriddedWindowSource:
        """Split `split` (data.splits.<split>) of data.path's files, the channels of
        data.variables, windows of data.window (`target_steps` overrides), seeded with
        train.seed, read ahead as ArraySource.from_sections says. `nan_fill` (one value per
        channel) overrides data.nan_fill."""
        d = sections.data
        if d.path is None:
            raise ArrayDataError(f"data.path is not set: the task {sections.task} reads gridded "
                                 f"files (NetCDF4 files, a directory or glob of them, or a "
                                 f"Zarr store)")
        if d.window is None:
            raise ArrayDataError(f"data.window is not set: the task {sections.task} trains on time "
                                 f"windows; set data.window.input_steps, target_steps, stride")
        splits = {k: v.model_dump() if hasattr(v, "model_dump") else v
                  for k, v in (d.splits or {}).items()}
        require_split(splits, split)      # the dates are read once the calendar is known
        until = sections.steps if split == "train" else d.eval_batches
        return cls(d.path, parse_channels(d.variables), fields, sections.batch_size,
                   input_name=input_name, target_name=target_name,
                   mask_name=mask_name,
                   constants=list(d.constants), input_steps=d.window.input_steps,
                   target_steps=d.window.target_steps if target_steps is None else
                   target_steps, stride=d.window.stride, splits=splits, split=split,
                   allow_split_overlap=d.allow_split_overlap,
                   time_gaps=d.time_gaps, latitude_order=d.latitude_order, nan=d.nan,
                   nan_fill=d.nan_fill if nan_fill is None else nan_fill,
                   standardize_constants=d.normalize,
                   seed=sections.seed, shuffle=shuffle, count=count,
                   prefetch=d.prefetch, read_threads=d.read_threads, prefetch_until=until,
                   shuffle_block=d.shuffle_block, shuffle_mix=d.shuffle_mix,
                   config_key=config_key)

    # --------------------------------------------------------- the timeline

    def _setup(self) -> None:
        super()._setup()
        self._timeline: Timeline | None = None
        self._starts = np.zeros(0, np.int64)
        self._range: tuple[Any, Any] = (None, None)   # the split's (start, end) axis times
        self._member_of: list[int] = []          # timeline file -> member of the index
        self._const: np.ndarray | None = None
        self._offsets_list: list[int] = []       # the timeline's file offsets (bisect)
        self._blocks: collections.OrderedDict[tuple[int, int], np.ndarray] = \
            collections.OrderedDict()
        self._block_rows: int = 1
        self._block_nan: dict[tuple[int, int], bool] = {}   # block -> holds a NaN
        self._cache_lock = threading.Lock()
        self._reader: GriddedReader | None = None   # the files' reads (built with the timeline)

    @property
    def timeline(self) -> Timeline:
        """The checked timeline of the files (built on first use)."""
        self.check()
        assert self._timeline is not None
        return self._timeline

    @property
    def frame(self) -> tuple[int, int, int]:
        """(latitude, longitude, channels) of one frame."""
        tl = self.timeline
        return len(tl.lat), len(tl.lon), len(self.channels)

    def _check(self, count: int | None) -> int:
        members = self.files.members
        paths = [m.path for m in members]
        tl = build_timeline(paths, self.channels, self.constants, where=self.where,
                            time_gaps=self.time_gaps, latitude_order=self.latitude_order)
        index = {str(Path(p)): i for i, p in enumerate(paths)}
        self._member_of = [index[str(f.path)] for f in tl.files]
        self._timeline = tl
        if self._reader is not None:
            self._reader.close()
        me = weakref.proxy(self)   # no cycle: a dropped source frees its blocks at once
        self._reader = GriddedReader(tl, lambda k: me._member(me._member_of[k]), self.where)
        self._offsets_list = [int(o) for o in tl.offsets]
        if self.splits is not None:
            start, end = split_range(self.splits, self.split, self.allow_split_overlap,
                                     calendar=tl.calendar)
        else:
            start, end = (t.astype(AXIS) if isinstance(t, np.datetime64) else
                          as_time(t, f"data.splits.{self.split}.{which}", which == "end",
                                  tl.calendar)
                          for t, which in zip(self.time_range, ("start", "end")))
        self._range = (start, end)
        self._starts = tl.window_starts(self.span, self.stride, start, end)
        w = self.window_key
        if not len(self._starts):
            lo, hi = tl.text(tl.times[0]), tl.text(tl.times[-1])
            raise ArrayDataError(
                f"{self.where}: split '{self.split}' (data.splits.{self.split}: "
                f"{self._range_text()}) holds no window of {self.span} steps ({w}.input_steps="
                f"{self.input_steps} + {w}.target_steps={self.target_steps}); the data run "
                f"from {lo} to {hi}, segments {[(int(a), int(b)) for a, b in tl.segments][:4]}")
        nlat, nlon, c = len(tl.lat), len(tl.lon), len(self.channels)
        k = len(self.constants)
        want = {self.input_name: (nlat, nlon, self.input_steps * c + k),
                self.target_name: (nlat, nlon, self.target_steps * c)}
        if self.mask_name:
            want[self.mask_name] = want[self.target_name]
        for name, shape in want.items():
            have = tuple(self.fields[name].example_shape)
            if have != shape:
                raise ArrayDataError(
                    f"{self.where}: batch field '{name}' has example shape {have}, but the "
                    f"files give {shape} (grid {nlat} x {nlon}, {c} channels of "
                    f"data.variables, {k} of data.constants in the input, "
                    f"{w}.input_steps={self.input_steps}, "
                    f"{w}.target_steps={self.target_steps}); fix the model's frame or those "
                    f"keys")
        total = len(self._starts)
        if count is not None and not 1 <= count <= total:
            raise ArrayDataError(f"{self.where}: {count} windows wanted but split "
                                 f"'{self.split}' holds {total}; lower the count")
        self._block_rows = self._choose_block_rows()
        if self.constants:
            self._const = self._reader.constants(self.constants,
                                                 self.standardize_constants)
        return total if count is None else int(count)

    def _choose_block_rows(self) -> int:
        """Rows per block: a multiple of the first variable's time chunk making about
        BLOCK_BYTES of decoded frames (at least one chunk, at most 64 MiB)."""
        nlat, nlon, c = len(self._timeline.lat), len(self._timeline.lon), len(self.channels)
        frame_bytes = nlat * nlon * c * 4
        chunk = None
        with self._member(self._member_of[0]) as store:
            array = store.get(self.channels[0].variable, "data.variables")
            f = self._timeline.files[0]
            dims = f.variables[self.channels[0].variable].dims
            chunks = getattr(array, "chunks", None)
            if chunks:
                chunk = int(chunks[dims.index(f.dims["time"])])
        if not chunk:
            return max(1, BLOCK_BYTES // frame_bytes)
        rows = chunk * max(1, BLOCK_BYTES // (chunk * frame_bytes))
        if rows * frame_bytes > MAX_BLOCK_BYTES:    # a huge chunk: read part of it
            rows = max(1, MAX_BLOCK_BYTES // frame_bytes)
        return rows

    def layout_warnings(self) -> list[str]:
        """One line per channel variable whose time chunks are longer than a read block:
        each block then decompresses whole chunks for a part of them (the cost grows with
        the chunk), with the command that rechunks the files."""
        self.check()
        tl, out = self._timeline, []
        for name in dict.fromkeys(c.variable for c in self.channels):
            for k, f in enumerate(tl.files):
                with self._member(self._member_of[k]) as store:
                    chunks = getattr(store.get(name, "data.variables"), "chunks", None)
                if not chunks:
                    continue
                dims = f.variables[name].dims
                ct = int(chunks[dims.index(f.dims["time"])])
                if ct <= self._block_rows:
                    continue
                spec = ",".join(f"{d}/{1 if d == f.dims['time'] else n}"
                                for d, n in zip(dims, f.variables[name].shape))
                fix = (f"spmd data rechunk IN OUT (or nccopy -c {spec} IN OUT)"
                       if f.format != "zarr" else "spmd data rechunk IN.zarr OUT.zarr (or "
                       "xarray: ds.chunk({'time': 1}).to_zarr(OUT))")
                out.append(f"file {f.path}: variable '{name}' is chunked {tuple(chunks)} "
                           f"({dims}): a read block of {self._block_rows} time steps "
                           f"decompresses chunks of {ct}; rechunk: {fix}")
                break
        return out

    def _range_text(self) -> str:
        """The split's range (data.splits) as dates of the data's calendar."""
        tl = self._timeline or self.timeline        # (_check's own errors: already built)
        start, end = (None if t is None else tl.text(t) for t in self._range)
        return f"{start or 'start'} .. {end or 'end'}"

    def time_text(self, t: np.datetime64) -> str:
        """A time of the windows (`window_of`) as a date of the data's calendar."""
        return self.timeline.text(t)

    def nan_text(self) -> str:
        """What is known of NaN in this split without reading it: the missing values per
        channel in the stored statistics of this split (`spmd data stats`), or that none
        were scanned (`spmd data info`)."""
        import json

        from spmd.data.stats.normalization import statistics_file

        try:
            target = statistics_file(self.path, self.where)
            entry = json.loads(target.read_text())["datasets"][self.statistics_key()]
            missing = {c.name: int(m) for c, m in zip(self.channels, entry["missing"]) if m}
        except (OSError, ValueError, KeyError, TypeError, ArrayDataError):
            return (f"data.nan: {self.nan}; NaN not scanned (`spmd data stats CONFIG` counts "
                    f"each channel's missing values of the train split)")
        if not missing:
            return f"data.nan: {self.nan}; no NaN in this split's statistics ({target})"
        counts = ", ".join(f"{name} {n}" for name, n in missing.items())
        hint = ("; data.nan: error stops at the first window holding one: set data.nan to "
                "mask or fill" if self.nan == "error" else "")
        return f"data.nan: {self.nan}; NaN in this split's statistics ({target}): {counts}{hint}"

    def covered_text(self) -> str:
        """What the split holds: the first window's first time .. the last window's last
        time (the data's own times, within `data.splits`: an end written as a date is its
        whole day)."""
        if self.count < 1:
            return self._range_text()
        first, last = self.window_of(0)["times"][0], self.window_of(self.count - 1)["times"][-1]
        return f"{self.time_text(first)} .. {self.time_text(last)}"

    def forecast_grid(self) -> ForecastGrid:
        """The coordinates of predictions from these windows, record by record (unshuffled:
        record i is window i; its initial time is its last input frame's)."""
        self.check()
        init = self.timeline.times[self._starts[:self.count] + self.input_steps - 1]
        return forecast_grid(self.timeline, self.channels, init)

    def window_of(self, record: int) -> dict[str, Any]:
        """Where window `record` lies: its first time, its times, and its (file, first row,
        stop row) pieces."""
        self.check()
        t0 = int(self._starts[record])
        tl = self.timeline
        return {"t0": t0, "times": tl.times[t0:t0 + self.span],
                "pieces": [(str(tl.files[k].path), lo, hi)
                           for k, lo, hi in tl.pieces(t0, t0 + self.span)]}

    def describe(self) -> str:
        """The timeline, the split and the channel table (`spmd data info`)."""
        tl = self.timeline
        units = {}
        for f in tl.files[:1]:
            units = {n: v.units for n, v in f.variables.items()}
        return (f"{self.where}: {tl.describe()}\nsplit {self.split} ({self.covered_text()}): "
                f"{self.count} windows of {self.span} steps, stride "
                f"{self.stride}; {self.nan_text()}\n"
                f"{channel_table(self.channels, self.constants, units)}"
                + "".join(f"\nwarning: {w}" for w in self.layout_warnings()))

    def statistics_plan(self) -> dict[str, tuple[bool, int]]:
        raise ArrayDataError(
            f"{self.where}: data.variables are decoded on read; their statistics are "
            f"GriddedWindowSource.statistics_part() (`spmd data stats CONFIG`), not the raw "
            f"arrays' (packed counts)")

    @property
    def block_rows(self) -> int:
        """Time steps per read block (a multiple of the files' time chunk)."""
        self.check()
        return self._block_rows

    def used_times(self) -> np.ndarray:
        """A bool per time of the timeline: True where one of the split's windows uses it."""
        used = np.zeros(len(self.timeline.times), bool)
        for t0 in self._starts[:self.count]:
            used[t0:t0 + self.span] = True
        return used

    def split_frames(self, every: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        """The frames of every time the split's windows use, a read block at a time in time
        order: (first timeline position, float32 (steps, lat, lon, C), decoded, NaN kept).
        With `every` > 1, only the first 1/every of each block (a sample spread evenly over
        the split, for a large one)."""
        used, rows = self.used_times(), self.block_rows
        edges = np.flatnonzero(np.diff(np.concatenate([[0], used.astype(np.int8), [0]])))
        for run_lo, run_hi in zip(edges[::2], edges[1::2]):
            step = min(rows, int(run_hi - run_lo))
            for a in range(int(run_lo), int(run_hi), step):
                b = min(a + -(-step // max(1, int(every))), a + step, int(run_hi))
                yield a, self._frames(a, b)

    def channel_statistics(self) -> dict[str, np.ndarray]:
        """Per channel over every time of the split's windows, NaN ignored (float64): count
        (valid values), mean, std (population), min, max. Blocks are merged with
        spmd.data.stats.normalization's pairwise update (Chan et al.), so a field of large mean
        (geopotential, ~5e4) keeps its std to float64 rounding."""
        c = len(self.channels)
        total = Moments.empty(c)
        for _, frames in self.split_frames():
            total = total.combine(Moments.of(frames.astype(np.float64).reshape(-1, c)))
        n = total.n.astype(np.float64)
        std = np.sqrt(np.maximum(total.m2 / np.maximum(n, 1), 0.0))
        used = int(self.used_times().sum())
        points = used * len(self.timeline.lat) * len(self.timeline.lon)
        return {"count": n, "mean": total.mean, "std": std, "m2": total.m2, "min": total.lo,
                "max": total.hi, "missing": points - n, "times": np.full(c, float(used))}

    def statistics_key(self) -> str:
        """The name of this split's channel statistics in the statistics file beside the
        data (spmd.data.stats.normalization): the channels and the time range."""
        return f"variables[{','.join(c.name for c in self.channels)}] {self._range_text()}"

    def statistics_part(self) -> dict[str, Any]:
        """channel_statistics in the merged form `normalization.write_statistics` stores
        (one entry, rows = the times used)."""
        st = self.channel_statistics()
        rows = int(st["times"][0])
        n = st["count"]

        def bound(v: np.ndarray) -> list[float | None]:
            return [float(x) if np.isfinite(x) else None for x in v]

        return {"datasets": {self.statistics_key(): {
            "per_channel": True, "channels": len(self.channels), "rows": rows,
            "range": [0, rows], "count": n.astype(np.int64).tolist(),
            "missing": np.asarray(st["missing"], np.int64).tolist(),
            "mean": st["mean"].tolist(), "m2": st["m2"].tolist(),
            "min": bound(st["min"]), "max": bound(st["max"])}}}

    # --------------------------------------------------------- reading

    def read_channel(self, k: int, channel: Channel, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of timeline file k's `channel`, decoded (xarray's dtype), as
        (time, latitude, longitude) in the timeline's latitude order."""
        self.check()
        return self._reader.decoded(k, channel, lo, hi)

    def _block(self, k: int, b: int) -> np.ndarray:
        """Block b of timeline file k: decoded float32 (rows, lat, lon, C), cached."""
        key = (k, b)
        with self._cache_lock:
            got = self._blocks.get(key)
            if got is not None:
                self._blocks.move_to_end(key)
                return got
        f = self.timeline.files[k]
        rows = len(f.times)
        lo, hi = b * self._block_rows, min((b + 1) * self._block_rows, rows)
        block = self._buffers.empty((hi - lo, len(self._timeline.lat),
                                     len(self._timeline.lon), len(self.channels)), np.float32)
        has_nan = False                           # once per block: windows skip the check
        for i, c in enumerate(self.channels):     # one copy into the block (decoded)
            raw = self._reader.raw(k, c, lo, hi, scratch=True)
            coding = f.variables[c.variable].coding
            values = raw if coding.identity else decode(raw, coding)
            if values.dtype.kind == "f":
                has_nan = has_nan or bool(np.isnan(values.min()))  # min keeps a NaN
            block[..., i] = values[:, ::-1] if f.flip_lat else values
        with self._cache_lock:
            self._blocks[key] = block
            self._block_nan[key] = has_nan
            total = sum(v.nbytes for v in self._blocks.values())
            while total > self.cache_bytes and len(self._blocks) > 1:
                gone, old = self._blocks.popitem(last=False)
                self._block_nan.pop(gone, None)
                total -= old.nbytes
        return block

    def _frames(self, lo: int, hi: int, into: np.ndarray | None = None) -> np.ndarray:
        """Timeline positions [lo, hi) as float32 (steps, lat, lon, C): a view of a cached
        block when one block holds them, else copied (into `into` when given)."""
        tl, n = self._timeline, self._block_rows
        if tl is None:
            tl = self.timeline
        offs = self._offsets_list
        k = bisect.bisect_right(offs, lo) - 1
        a, b = lo - offs[k], hi - offs[k]
        if b <= offs[k + 1] - offs[k] and a // n == (b - 1) // n:
            blk = a // n                                  # the common case: one block
            view = self._block(k, blk)[a - blk * n:b - blk * n]
            if into is not None:
                into[...] = view
                return into
            return view
        out = []
        for k, a, b in tl.pieces(lo, hi):
            for blk in range(a // n, (b - 1) // n + 1):
                block = self._block(k, blk)
                s, e = max(a, blk * n) - blk * n, min(b, (blk + 1) * n) - blk * n
                out.append(block[s:e])
        return np.concatenate(out, axis=0, out=into)

    def _nan_error(self, record: int, t0: int, window: np.ndarray) -> ArrayDataError:
        bad = np.isnan(window).reshape(window.shape[0], -1, window.shape[-1])
        step, channel = map(int, np.argwhere(bad.any(1))[0])
        tl = self.timeline
        k, row, _ = tl.pieces(t0 + step, t0 + step + 1)[0]
        c = self.channels[channel]
        level = "" if c.level is None else f" at level {c.level:g}"
        when = tl.text(tl.times[t0 + step])
        return ArrayDataError(
            f"{self.where}: file {tl.files[k].path}: variable '{c.variable}'{level} is NaN at "
            f"time index {row} ({when}) in {int(bad[step, :, channel].sum())} grid point(s) "
            f"(window {record} of split '{self.split}'); fix the data, or set data.nan: mask "
            f"(the loss skips missing points) or data.nan: fill")

    def rows(self, step: int, start: int, stop: int,
             region: Mapping[str, Region | None] | None = None) -> dict[str, np.ndarray]:
        """Rows [start, stop) of step `step`: whole examples (a region is cut in memory)."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"{self.where}: rows [{start}, {stop}) outside the batch of "
                             f"{self.batch_size}")
        records = self.record_indices(step, start, stop)
        # from ArraySource's pool: memory used before (a fresh one costs page faults)
        out = {name: self._buffers.empty((len(records), *f.example_shape), f.dtype)
               for name, f in self.fields.items()}
        self.check()
        if self._rows_from_blocks(records, out):
            if region:
                for name, box in region.items():
                    if box is not None and name in out:
                        out[name] = out[name][(slice(None),
                                               *(slice(lo, hi) for lo, hi in box))]
            return out
        tl, nlat, nlon, c = self._timeline, *self.frame
        windows = np.empty((len(records), self.span, nlat, nlon, c), np.float32)
        per_file: collections.Counter[int] = collections.Counter()
        for i, record in enumerate(records):          # one copy per window from the blocks
            t0 = int(self._starts[record])
            self._frames(t0, t0 + self.span, into=windows[i])
            k0 = bisect.bisect_right(self._offsets_list, t0) - 1
            k1 = bisect.bisect_right(self._offsets_list, t0 + self.span - 1) - 1
            per_file[k0] += 1
            if k1 != k0:
                per_file.update(range(k0 + 1, k1 + 1))
        missing = np.isnan(windows)
        if missing.any():
            if self.nan == "error":
                i = int(np.flatnonzero(missing.reshape(len(records), -1).any(1))[0])
                raise self._nan_error(records[i], int(self._starts[records[i]]), windows[i])
            np.copyto(windows, np.broadcast_to(self.nan_fill, windows.shape), where=missing)
        k = self.input_steps
        # (n, steps, lat, lon, C) -> (n, lat, lon, steps * C): the frames in time order
        frames = windows[:, :k].transpose(0, 2, 3, 1, 4).reshape(-1, nlat, nlon, k * c)
        if self._const is not None:
            out[self.input_name][..., :k * c] = frames
            out[self.input_name][..., k * c:] = self._const
        else:
            out[self.input_name][...] = frames
        out[self.target_name][...] = windows[:, k:].transpose(0, 2, 3, 1, 4).reshape(
            -1, nlat, nlon, (self.span - k) * c)
        if self.mask_name:
            out[self.mask_name][...] = ~missing[:, k:].transpose(0, 2, 3, 1, 4).reshape(
                -1, nlat, nlon, (self.span - k) * c)
        nbytes = windows.nbytes
        if region:
            for name, box in region.items():
                if box is not None and name in out:
                    out[name] = out[name][(slice(None), *(slice(lo, hi) for lo, hi in box))]
        self._count_reads([(self.channels[0].variable, r, ()) for r in records], nbytes,
                          collections.Counter({str(tl.files[f].path): n
                                               for f, n in per_file.items()}))
        return out

    def _rows_from_blocks(self, records: Sequence[int], out: dict[str, np.ndarray]) -> bool:
        """The common case, fast: the windows hold no NaN. A window inside one cached block
        (that holds no NaN) is copied frame by frame from the block straight into its place
        in the output (no window array, no NaN pass); one across blocks or files is joined
        (`_frames`) and checked. False (out possibly half written) when a NaN is met: `rows`
        then takes the general path, which applies data.nan."""
        n, span, offs = self._block_rows, self.span, self._offsets_list
        where: list[tuple[Any, int, int]] = []
        per_file: collections.Counter[str] = collections.Counter()
        files = self._timeline.files
        for record in records:
            t0 = int(self._starts[record])
            k = bisect.bisect_right(offs, t0) - 1
            a = t0 - offs[k]
            if a + span > offs[k + 1] - offs[k] or a // n != (a + span - 1) // n:
                window = self._frames(t0, t0 + span)      # across blocks or files: joined
                if np.isnan(window).any():
                    return False
                where.append((window, 0, 0))
                k1 = bisect.bisect_right(offs, t0 + span - 1) - 1
                per_file.update(str(files[j].path) for j in range(k, k1 + 1))
                continue
            where.append((k, a // n, a - (a // n) * n))
            per_file[str(files[k].path)] += 1
        blocks = {}
        for k, b, _ in where:
            if not isinstance(k, np.ndarray) and (k, b) not in blocks:
                blocks[(k, b)] = self._block(k, b)
                with self._cache_lock:
                    if self._block_nan.get((k, b), True):
                        return False
        c, steps = len(self.channels), self.input_steps
        inp, tgt = out[self.input_name], out[self.target_name]
        whole = self._const is None and steps == 1
        for i, (k, b, a) in enumerate(where):
            block = k if isinstance(k, np.ndarray) else blocks[(k, b)]
            if whole:
                inp[i] = block[a]
            else:
                for s in range(steps):
                    inp[i, ..., s * c:(s + 1) * c] = block[a + s]
            if span - steps == 1:
                tgt[i] = block[a + steps]
            else:
                for s in range(steps, span):
                    tgt[i, ..., (s - steps) * c:(s - steps + 1) * c] = block[a + s]
        if self._const is not None:
            inp[..., steps * c:] = self._const
        if self.mask_name:
            out[self.mask_name][...] = 1
        nbytes = len(records) * span * int(np.prod(self.frame)) * 4
        self._count_reads([(self.channels[0].variable, r, ()) for r in records], nbytes,
                          per_file)
        return True

    def close(self) -> None:
        """Close the files (the store handles and the h5py handles of NetCDF4 reads)."""
        super().close()
        if self._reader is not None:
            self._reader.close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for k in ("_timeline", "_starts", "_member_of", "_const", "_blocks", "_block_rows",
                  "_cache_lock", "_offsets_list", "_block_nan", "_reader"):
            state.pop(k, None)
        return state
