"""Time windows of stored trajectories as the examples of a batch (`data.window`).

One dataset path holds trajectories: `[trajectory, time, *frame]` in each member file of
`data.path`, or `[time, *frame]`, one trajectory per member file (lengths may differ
between files). An example is a window of `span = input_steps + target_steps` consecutive
frames: the first `input_steps` are the input field, the next `target_steps` the target
field. Nothing is written to disk: each window is read where it lies.

Invariants:
- A trajectory of T steps gives the windows starting at t0 = 0, stride, 2 * stride, ...
  while t0 + span <= T. A window never crosses a trajectory boundary, nor a file boundary.
- Record `i` is the i-th window enumerated member by member (sorted path order), then
  trajectory by trajectory, then by t0: a pure function of the files' shapes, so a file
  split into parts gives the same records. `count` keeps the first `count` windows.
- The order of the records (seeded grain shuffle, repeated) is ArraySource's: a pure
  function of (seed, step, row), the same for any process count.
- Layout of a window in the batch fields: `"channels"` concatenates the frames along the
  last axis in time order (frame `(x, y, C)` -> input `(x, y, input_steps * C)`);
  `"time"` stacks them on a leading axis (input `(input_steps, x, y, C)`). The frame shape
  follows from the layout and the fields; a stored frame may lack a trailing channel axis
  of size 1 (added on read), and every member stores the same layout.
- `rows` reads each window with ONE read of `array[row, t0:t0 + span, *slab]` (the union
  of the fields' slabs): a process under `spatial` reads only its x/y slab of a chunked
  store. A region that splits the channel axis ("channels") or the time axis ("time") is
  read whole along that axis and sliced in memory. Values are cast to the field's dtype.
- Counters: `records_read` counts windows read (one read each), `bytes_read` their bytes,
  `reads_by_file` the reads per member, `last_reads` (dataset, record, (time slice,
  *frame slices)) of the last call. `rows` is thread safe; the source pickles without its
  open files.
- Every error names the file, the dataset path and the key to change (`data.window.*`,
  `data.fields.*`, `data.path`); a damaged file's error names the window too.
- A CF-coded NetCDF / Zarr variable (packed, fill values) is decoded as xarray decodes it,
  per member file (ArraySource's rule, spmd.data.cf.cf_decode).
- Windows of stored arrays take axes by position: a NetCDF / Zarr variable whose dimension
  names put a level or a grid axis first is refused (gridded files are read by
  spmd.data.sources.gridded_windows, `data.variables`); so is a test split read from a path
  without `{split}` (it would be the train split).
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from spmd.data.batch import BatchField
from spmd.data.cf.cf_decode import decode
from spmd.data.data_config import SourceSections
from spmd.data.formats.stores import ArrayDataError
from spmd.data.sources.arrays import ArraySource, Region

__all__ = ["LAYOUTS", "WindowSource"]

log = logging.getLogger("spmd.data")

LAYOUTS = ("channels", "time")


class WindowSource(ArraySource):
    """Windows of the trajectories at `dataset` as rows of the fields `input_name` (the
    first `input_steps` frames) and `target_name` (the next `target_steps`).

    `fields` holds exactly those two BatchFields, laid out as `layout` says; `stride` is
    the time steps between window starts. `window_key` names the config section that
    errors tell the user to change; the rest is as ArraySource.
    """

    def __init__(self, path: str | Path, dataset: str, fields: Mapping[str, BatchField],
                 batch_size: int, *, input_name: str, target_name: str, input_steps: int = 1,
                 target_steps: int = 1, stride: int = 1,
                 layout: Literal["channels", "time"] = "channels", seed: int = 0,
                 shuffle: bool = True, count: int | None = None, config_key: str = "data.path",
                 fields_key: str = "data.fields", window_key: str = "data.window",
                 prefetch: int = 0, read_threads: int = 1, prefetch_until: int | None = None,
                 max_open: int = 64, shuffle_block: int | str | None = "auto",
                 shuffle_mix: int = 16):
        self.dataset, self.layout, self.window_key = dataset, layout, window_key
        self.input_name, self.target_name = input_name, target_name
        self.input_steps, self.target_steps = int(input_steps), int(target_steps)
        self.stride = int(stride)
        self.span = self.input_steps + self.target_steps
        for key, value in (("input_steps", input_steps), ("target_steps", target_steps),
                           ("stride", stride)):
            if int(value) < 1:
                raise ArrayDataError(f"{window_key}.{key}={value}: must be at least 1")
        if layout not in LAYOUTS:
            raise ValueError(f"WindowSource: layout {layout!r} is not one of {list(LAYOUTS)}")
        if input_name == target_name or set(fields) != {input_name, target_name}:
            raise ValueError(f"WindowSource: fields {sorted(fields)} must be exactly the input "
                             f"'{input_name}' and the target '{target_name}'")
        self.frame = self._frame(fields, fields_key)
        super().__init__(path, {input_name: dataset, target_name: dataset}, fields,
                         batch_size, seed=seed, shuffle=shuffle, count=count,
                         config_key=config_key, fields_key=fields_key, prefetch=prefetch,
                         read_threads=read_threads, prefetch_until=prefetch_until,
                         max_open=max_open, shuffle_block=shuffle_block,
                         shuffle_mix=shuffle_mix)

    def _frame(self, fields: Mapping[str, BatchField], fields_key: str) -> tuple[int, ...]:
        """The shape of one stored frame, from the layout and the fields' example shapes."""
        steps = {self.input_name: self.input_steps, self.target_name: self.target_steps}
        keys = {self.input_name: "input_steps", self.target_name: "target_steps"}
        frames = {}
        for name, field in fields.items():
            shape, n = field.example_shape, steps[name]
            what = (f"batch field '{name}' ({fields_key}.{name}) has example shape {shape}, "
                    f"but with layout '{self.layout}' and {self.window_key}.{keys[name]}={n}")
            if self.layout == "channels":
                if not shape or shape[-1] % n:
                    raise ArrayDataError(f"{what} its last axis must hold {n} frames of equal "
                                         f"channels; set {self.window_key}.{keys[name]} to "
                                         f"match the model's channels")
                frames[name] = (*shape[:-1], shape[-1] // n)
            else:
                if not shape or shape[0] != n:
                    raise ArrayDataError(f"{what} its leading (time) axis must be {n}; set "
                                         f"{self.window_key}.{keys[name]} to match the model")
                frames[name] = shape[1:]
        if frames[self.input_name] != frames[self.target_name]:
            raise ArrayDataError(
                f"batch fields '{self.input_name}' {fields[self.input_name].example_shape} and "
                f"'{self.target_name}' {fields[self.target_name].example_shape} imply different "
                f"frames {frames[self.input_name]} and {frames[self.target_name]} with "
                f"{self.window_key}.input_steps={self.input_steps}, "
                f"{self.window_key}.target_steps={self.target_steps}; fix those keys")
        return frames[self.input_name]

    @classmethod
    def from_sections(cls, sections: SourceSections, split: str,
                      fields: Mapping[str, BatchField], dataset: str, *, input_name: str,
                      target_name: str, layout: Literal["channels", "time"] = "channels",
                      shuffle: bool, target_steps: int | None = None,
                      count: int | None = None) -> WindowSource:
        """Windows of split `split`: trajectories at `dataset` ("{split}" filled in; or
        data.fields.<input_name>) in data.path, steps and stride from data.window
        (`target_steps` overrides, e.g. for longer rollouts on the test split), seeded with
        train.seed, read ahead as ArraySource.from_sections says."""
        d = sections.data
        if d.path is None:
            raise ArrayDataError(f"data.path is not set: the task {sections.task} reads "
                                 f"trajectories from a file (made by `spmd data make CONFIG`)")
        if d.variables is not None:
            raise ArrayDataError(
                f"data.variables is set, but the task {sections.task} reads stored arrays "
                f"(data.fields); gridded files need a task built on "
                f"spmd.tasks.gridded_task.GriddedTrajectoryTask (or unset data.variables)")
        window = d.window
        if window is None:
            raise ArrayDataError(f"data.window is not set: the task {sections.task} trains on time "
                                 f"windows of trajectories; set data.window.input_steps, "
                                 f"data.window.target_steps and data.window.stride")
        named = dict(d.fields)
        unknown = sorted(set(named) - set(fields))
        if unknown:
            raise ArrayDataError(f"data.fields names {unknown}, which are not batch fields "
                                 f"of the task {sections.task} (its fields: {sorted(fields)})")
        path = named.get(input_name) or dataset
        if named.get(target_name) and named[target_name] != path:
            raise ArrayDataError(
                f"data.fields.{target_name}={named[target_name]}: the target of a window is "
                f"read from the same trajectories as the input; set data.fields.{input_name} "
                f"only (now {path})")
        if "{split}" not in path and split != "train":
            raise ArrayDataError(
                f"data.fields.{input_name}={path} has no {{split}}: the {split} split would "
                f"read the train split's trajectories; store the splits in groups and write "
                f"the path as {{split}}/<name>, or give gridded files data.variables and "
                f"data.splits (time ranges)")
        until = sections.steps if split == "train" else d.eval_batches
        return cls(d.path, path.format(split=split), fields, sections.batch_size,
                   input_name=input_name, target_name=target_name,
                   input_steps=window.input_steps,
                   target_steps=window.target_steps if target_steps is None else target_steps,
                   stride=window.stride, layout=layout, seed=sections.seed, shuffle=shuffle,
                   count=count, prefetch=d.prefetch,
                   read_threads=d.read_threads, prefetch_until=until,
                   shuffle_block=d.shuffle_block, shuffle_mix=d.shuffle_mix)

    # --------------------------------------------------------- the windows

    def _setup(self) -> None:
        super()._setup()
        self._first: list[int] = []        # per member: its first window's record
        self._per_row: list[int] = []      # per member: windows per trajectory
        self._stored: tuple[int, ...] = ()  # per member: leading-axis rows
        self._squeezed = False             # the stored frame lacks its channel axis of 1
        self._one_per_file = False         # members are [time, *frame]

    def _layout_of(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool] | None:
        """(leading axes, squeezed) of a stored shape, or None when it holds no frames."""
        k = len(self.frame)
        if len(shape) in (k + 1, k + 2) and shape[len(shape) - k:] == self.frame:
            return shape[:len(shape) - k], False
        if self.frame[-1:] == (1,) and len(shape) in (k, k + 1) and \
                shape[len(shape) - k + 1:] == self.frame[:-1]:
            return shape[:len(shape) - k + 1], True
        return None

    def _check(self, count: int | None) -> int:
        """Every member's dataset holds trajectories of this frame; the windows used."""
        key = f"{self.fields_key}.{self.input_name}"
        shapes = self._shapes(self.input_name)
        layouts = []
        for i, shape in enumerate(shapes):
            got = self._layout_of(shape)
            if got is None:
                w = self.window_key
                raise ArrayDataError(
                    f"{self._where(i)}: dataset '{self.dataset}' ({key}) has shape {shape}, "
                    f"but the batch fields '{self.input_name}' "
                    f"{self.fields[self.input_name].example_shape} and '{self.target_name}' "
                    f"{self.fields[self.target_name].example_shape} (layout '{self.layout}', "
                    f"{w}.input_steps={self.input_steps}, {w}.target_steps={self.target_steps}) "
                    f"need frames of shape {self.frame}: a dataset [trajectory, time, "
                    f"*{self.frame}] or [time, *{self.frame}] (one trajectory per file); fix "
                    f"{w}.input_steps / {w}.target_steps, the model's fields, or point {key} "
                    f"at another dataset")
            layouts.append((len(got[0]), got[1]))
        if len(set(layouts)) > 1:
            kinds = {str(self.files.members[i].path): shapes[i] for i in range(len(shapes))}
            raise ArrayDataError(f"{self.where}: the member files store dataset "
                                 f"'{self.dataset}' ({key}) in different layouts {kinds}; "
                                 f"every file must be [trajectory, time, *frame] or every "
                                 f"file [time, *frame]")
        self._one_per_file = layouts[0][0] == 1
        self._squeezed = layouts[0][1]
        self._refuse_cf(layouts[0][0])
        self._check_coding()
        first, per_row, longest, short = [0], [], 0, 0
        for shape in shapes:
            rows, steps = (1, shape[0]) if self._one_per_file else (shape[0], shape[1])
            n = (steps - self.span) // self.stride + 1 if steps >= self.span else 0
            per_row.append(n)
            first.append(first[-1] + rows * n)
            longest = max(longest, steps if rows else 0)
            short += rows if n == 0 else 0
        self._first, self._per_row = first, per_row
        self._stored = tuple(int(s[0]) for s in shapes)
        total = first[-1]
        w = self.window_key
        if total == 0 and longest:
            raise ArrayDataError(
                f"{self.where}: dataset '{self.dataset}' ({key}): no trajectory is long "
                f"enough for one window of {self.span} steps ({w}.input_steps="
                f"{self.input_steps} + {w}.target_steps={self.target_steps}); the longest has "
                f"{longest} steps: lower {w}.input_steps or {w}.target_steps")
        if total == 0:
            raise ArrayDataError(f"{self.where}: dataset '{self.dataset}' ({key}) holds no "
                                 f"trajectory, so 0 windows; point {key} or data.path at "
                                 f"the trajectories")
        if short:
            log.warning("%s: %d trajectories of '%s' are shorter than a window of %d steps "
                        "and give no window", self.where, short, self.dataset, self.span)
        if count is not None and not 1 <= count <= total:
            raise ArrayDataError(f"{self.where}: {count} windows wanted but dataset "
                                 f"'{self.dataset}' holds {total} (with {w}.stride="
                                 f"{self.stride}); lower the count or {w}.stride")
        return total if count is None else int(count)

    def _refuse_cf(self, leading: int) -> None:
        """A NetCDF / Zarr variable whose named dims put a level or a grid axis where the
        windows read trajectory or time would be read wrong without a word (level as time):
        refused, pointing at data.variables. (CF packing is decoded, `_check_coding`.)"""
        with self._member(0) as store:
            if store.format not in ("netcdf", "netcdf3", "zarr"):
                return
            array = store.get(self.dataset, f"{self.fields_key}.{self.input_name}")
            dims = getattr(array, "dimensions", None)
            if dims is None and store.format == "zarr":
                dims = getattr(getattr(array, "metadata", None), "dimension_names", None)
        where = (f"{self._where(0)}: variable '{self.dataset}' "
                 f"({self.fields_key}.{self.input_name})")
        named = [str(d) for d in (dims or ()) if d]
        axes = {"level", "pressure_level", "plev", "isobaricInhPa", "lev", "latitude", "lat",
                "longitude", "lon"}
        wrong = [d for d in named[:leading] if d in axes]
        if wrong:
            axis = "the time" if leading == 1 else "the trajectory or time"
            raise ArrayDataError(f"{where} has dims {named}: windows of stored arrays would "
                                 f"read '{wrong[0]}' as {axis} axis; list it in "
                                 f"data.variables (dims taken by name, with data.splits)")

    def locate(self, name: str, record: int) -> tuple[int, int]:
        """(member, trajectory row in it; -1 for a one-trajectory file) of window `record`."""
        member, row, _ = self._window(record)
        return member, row

    def _window(self, record: int) -> tuple[int, int, int]:
        """(member, trajectory row or -1, t0) of window `record`."""
        self.check()
        if not 0 <= record < self._first[-1]:
            raise IndexError(f"{self.where}: window {record} outside [0, {self._first[-1]})")
        member = bisect.bisect_right(self._first, record) - 1
        k = record - self._first[member]
        row, t = divmod(k, self._per_row[member])
        return member, -1 if self._one_per_file else row, t * self.stride

    def window_of(self, record: int) -> tuple[str, int, int]:
        """(member file path, trajectory row or -1 for a one-trajectory file, t0)."""
        member, row, t0 = self._window(record)
        return str(self.files.members[member].path), row, t0

    def statistics_plan(self) -> dict[str, tuple[bool, int]]:
        """Per stored dataset path read: (per channel, leading-axis rows used): every row
        of the concatenated dataset; per channel when the frame has a channel axis."""
        self.check()
        per_channel = (self.fields[self.input_name].axes[-1] == "channels"
                       and not self._squeezed)
        return {self.dataset: (per_channel, int(sum(self._stored)))}

    # --------------------------------------------------------- reading

    def _boxes(self, region: Mapping[str, Region | None] | None
               ) -> tuple[Region, dict[str, tuple[Region, tuple[int, int] | None]]]:
        """The frame slab to read (the union of the fields') and, per field, its frame
        slab and the range of its window axis to keep (None: all of it)."""
        per: dict[str, tuple[Region, tuple[int, int] | None]] = {}
        for name, field in self.fields.items():
            shape = field.example_shape
            box = (region or {}).get(name) or tuple((0, n) for n in shape)
            if self.layout == "channels":
                frame_box, axis, full = (*box[:-1], (0, self.frame[-1])), box[-1], shape[-1]
            else:
                frame_box, axis, full = tuple(box[1:]), box[0], shape[0]
            per[name] = (tuple(frame_box), None if tuple(axis) == (0, full) else tuple(axis))
        union = tuple((min(b[a][0] for b, _ in per.values()), max(b[a][1] for b, _ in
                                                                   per.values()))
                      for a in range(len(self.frame)))
        return union, per

    def _lay_out(self, frames: np.ndarray) -> np.ndarray:
        """`(steps, *frame slab)` -> the field's example layout."""
        if self.layout == "time":
            return frames
        moved = np.moveaxis(frames, 0, -2)          # (*slab[:-1], steps, C)
        return moved.reshape(*moved.shape[:-2], -1)

    def rows(self, step: int, start: int, stop: int,
             region: Mapping[str, Region | None] | None = None) -> dict[str, np.ndarray]:
        """Rows [start, stop) of step `step` (one read per window); of field f only
        `region[f]` when given."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"{self.where}: rows [{start}, {stop}) outside the batch of "
                             f"{self.batch_size}")
        records = self.record_indices(step, start, stop)
        union, per = self._boxes(region)
        out = {}
        for name, field in self.fields.items():
            shape = tuple(hi - lo for lo, hi in (region or {}).get(name)
                          or tuple((0, n) for n in field.example_shape))
            out[name] = np.empty((len(records), *shape), dtype=field.dtype)
        stored = union[:-1] if self._squeezed else union
        frame_index = tuple(slice(lo, hi) for lo, hi in stored)
        reads: list[tuple[str, int, tuple[slice, ...]]] = []
        nbytes, per_file = 0, collections.Counter()
        for i, record in enumerate(records):
            member, row, t0 = self._window(record)
            window = (slice(t0, t0 + self.span), *frame_index)
            with self._member(member) as store:
                array = store.get(self.dataset, f"{self.fields_key}.{self.input_name}")
                got = self._read_window(array, window if row < 0 else (row, *window),
                                        member, record, row, t0)
                coding = self._coding(member, self.input_name, store)
            if coding is not None:                    # CF-coded: as xarray decodes it
                got = decode(got, coding)
            nbytes += got.nbytes
            if self._squeezed:
                got = got[..., None]
            parts = {self.input_name: got[:self.input_steps],
                     self.target_name: got[self.input_steps:]}
            for name, (frame_box, keep) in per.items():
                crop = tuple(slice(lo - u, hi - u) for (lo, hi), (u, _) in zip(frame_box, union))
                value = self._lay_out(parts[name][(slice(None), *crop)])
                if keep is not None:
                    axis = -1 if self.layout == "channels" else 0
                    value = np.take(value, np.arange(*keep), axis=axis)
                out[name][i] = value
            per_file[str(self.files.members[member].path)] += 1
            reads.append((self.dataset, record, window))
        self._count_reads(reads, nbytes, per_file)
        return out

    def _read_window(self, array: Any, index: tuple, member: int, record: int, row: int,
                     t0: int) -> np.ndarray:
        try:
            return np.asarray(array[index])
        except (OSError, KeyError, RuntimeError, ValueError) as e:  # a damaged chunk
            which = "the file's trajectory" if row < 0 else f"trajectory {row} of the file"
            raise ArrayDataError(
                f"{self._where(member)}: reading window {record} ({which}, time steps "
                f"{t0}..{t0 + self.span - 1}) of dataset '{self.dataset}' "
                f"({self.fields_key}.{self.input_name}) failed ({type(e).__name__}: {e}); "
                f"the file may be truncated or corrupt (left unchanged)") from None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for k in ("_first", "_per_row", "_stored", "_squeezed", "_one_per_file"):
            state.pop(k, None)
        return state
