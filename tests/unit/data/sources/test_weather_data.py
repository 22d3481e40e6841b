"""Weather and climate files as they exist (issue 35): CF decoding, coordinates by name,
variables and levels as channels, date splits, windows across files, NaN policies.

The fixtures are written by xarray (tests/helpers/era5_files.py), never by spmd: yearly
ERA5-like NetCDF4 files (u10 CF-packed int16, 2001 zlib-compressed, geopotential with a
level dim) and a WeatherBench2-like Zarr v3 store (time, level, longitude, latitude). Each
file set is written once per module.
"""

from __future__ import annotations

import dataclasses

import netCDF4
import numpy as np
import pytest
import xarray as xr

from spmd.data.batch import BatchField
from spmd.data.cf.cf_decode import coding_of, decode
from spmd.data.cf.channels import Channel, parse_channels
from spmd.data.cf.time_splits import check_splits, split_range
from spmd.data.data_config import DataConfig, WindowConfig
from spmd.data.formats.stores import ArrayDataError, detect_format
from spmd.data.sources.gridded_windows import GriddedWindowSource
from tests.helpers.era5_files import LEVELS, grid, land, write_era5_years, write_wb2_zarr

VARIABLES = ["t2m", "u10", "v10", "msl", {"geopotential": [500, 850]}]
AXES = ("batch", "x", "y", "channels")
END_2001 = np.datetime64("2001-12-31T23:00", "ns")
START_2002 = np.datetime64("2002-01-01T00:00", "ns")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("era5")
    return {
        "nc": write_era5_years(root / "nc"),
        "zarr": write_wb2_zarr(root / "wb2.zarr", time_chunk=64),
        "gap": write_era5_years(root / "gap", (2000, 2001), zlib_year=None, gap_days=10,
                                gap_year=2000),
        "flip": write_era5_years(root / "flip", (2000, 2001), zlib_year=None,
                                 reversed_lat_year=2001),
        "sst": write_era5_years(root / "sst", (2000, 2001), zlib_year=None, sst=True,
                                nan_at=("t2m", 2001, 40)),
        "root": root,
    }


def source(path, variables=VARIABLES, *, steps=(1, 1), mask=False, constants=(), **kw):
    channels = parse_channels(variables)
    nlat, nlon = len(grid()[0]), len(grid()[1])
    c, k = len(channels), len(constants)
    fields = {"input": BatchField((nlat, nlon, steps[0] * c + k), np.float32, AXES),
              "target": BatchField((nlat, nlon, steps[1] * c), np.float32, AXES)}
    if mask:
        fields["mask"] = BatchField((nlat, nlon, steps[1] * c), np.float32, AXES)
    kw.setdefault("shuffle", False)
    return GriddedWindowSource(path, channels, fields, 4, input_name="input",
                               target_name="target", mask_name="mask" if mask else None,
                               constants=constants, input_steps=steps[0],
                               target_steps=steps[1], **kw)


def xarray_frames(paths, variables=VARIABLES) -> np.ndarray:
    """(time, lat, lon, C) of the channels, by xarray alone, files concatenated in time."""
    out = []
    for p in paths:
        ds = xr.open_dataset(p).load() if str(p).endswith(".nc") else \
            xr.open_zarr(p, consolidated=False).load()
        chans = []
        for c in parse_channels(variables):
            v = ds[c.variable]
            if c.level is not None:
                v = v.sel(level=int(c.level))
            chans.append(v.transpose("time", "latitude", "longitude").values.astype(np.float32))
        out.append(np.stack(chans, -1))
    return np.concatenate(out)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------- CF decoding


def test_decoded_values_equal_xarray_element_for_element(files):
    """Every variable of every file (packed int16, zlib, level dim, WB2 dim order) decodes
    to what xarray's open_dataset(...).load() returns, dtype included."""
    src = source(files["root"] / "nc", time_range=(None, END_2001))
    for k, path in enumerate(files["nc"]):
        ds = xr.open_dataset(path).load()
        for c in parse_channels(VARIABLES):
            got = src.read_channel(k, c, 0, ds.sizes["time"])
            want = ds[c.variable]
            if c.level is not None:
                want = want.sel(level=int(c.level))
            want = want.values
            assert got.dtype == want.dtype, (path, c)
            assert np.array_equal(got, want, equal_nan=True), (path, c)
    ds = xr.open_dataset(files["nc"][0])
    assert ds["u10"].encoding["dtype"] == np.int16 and ds["u10"].dtype == np.float64
    zsrc = source(files["zarr"], time_range=(None, END_2001))
    zds = xr.open_zarr(files["zarr"], consolidated=False).load()
    assert zds["geopotential"].dims == ("time", "level", "longitude", "latitude")
    for c in parse_channels(VARIABLES):
        want = zds[c.variable]
        if c.level is not None:
            want = want.sel(level=int(c.level))
        want = want.transpose("time", "latitude", "longitude").values
        got = zsrc.read_channel(0, c, 0, zds.sizes["time"])
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True), c


def test_fill_values_become_nan_as_in_xarray(tmp_path):
    """_FillValue and missing_value of a packed variable are NaN after decoding, as xarray."""
    lat, lon = grid()
    t = np.arange(np.datetime64("2000-01-01", "ns"), np.datetime64("2000-01-05", "ns"),
                  np.timedelta64(1, "D"))
    v = np.linspace(-3, 3, len(t) * len(lat) * len(lon)).reshape(len(t), len(lat), len(lon))
    v[0, 0, 0] = np.nan
    ds = xr.Dataset({"u": (("time", "latitude", "longitude"), v)},
                    coords={"time": t, "latitude": lat, "longitude": lon})
    path = tmp_path / "f.nc"
    ds.to_netcdf(path, encoding={"u": {"dtype": "int16", "scale_factor": np.float32(0.001),
                                       "add_offset": np.float32(1.0), "_FillValue": -999,
                                       "missing_value": -999}})
    back = xr.open_dataset(path).load()
    import h5py

    with h5py.File(path, "r") as f:
        raw = f["u"][...]
    got = decode(raw, coding_of(back["u"], "f", "u"))
    assert raw[0, 0, 0] == -999 and np.isnan(got[0, 0, 0])
    assert got.dtype == back["u"].dtype == np.float32
    assert np.array_equal(got, back["u"].values, equal_nan=True)


# --------------------------------------------------------------------- channels, windows


def test_four_variables_and_two_levels_are_six_channels(files):
    src = source(files["root"] / "nc", time_range=(None, END_2001))
    assert [c.name for c in src.channels] == ["t2m", "u10", "v10", "msl", "geopotential_500",
                                              "geopotential_850"]
    assert src.frame == (6, 12, 6)
    text = src.describe()
    assert "geopotential_850" in text and "3 file(s)" in text and "every 24 h" in text
    rows = src.rows(0, 0, 4)                      # windows 0..3 in time order
    want = xarray_frames(files["nc"])
    for i in range(4):
        assert np.array_equal(rows["input"][i], want[i])
        assert np.array_equal(rows["target"][i], want[i + 1])
    wb2 = source(files["zarr"], time_range=(None, END_2001), latitude_order="north_to_south")
    assert np.array_equal(wb2.rows(0, 0, 4)["input"], rows["input"])   # same data, same order


def test_date_split_holds_out_the_last_year(files):
    splits = {"train": {"end": "2001-12-31T23:00"}, "test": {"start": "2002-01-01"}}
    train = source(files["root"] / "nc", time_range=split_range(splits, "train"))
    test = source(files["root"] / "nc", time_range=split_range(splits, "test"), split="test")
    assert train.count == 366 + 365 - 1 and test.count == 365 - 1
    last = train.window_of(train.count - 1)["times"]
    assert last[-1] < START_2002
    assert all(test.window_of(r)["times"][0] >= START_2002 for r in (0, test.count - 1))
    zarr_test = source(files["zarr"], time_range=split_range(splits, "test"), split="test")
    assert zarr_test.count == test.count        # a year held out of one Zarr store


def test_windows_cross_yearly_file_boundaries(files):
    src = source(files["root"] / "nc", steps=(2, 3), time_range=(None, None))
    crossing = [r for r in range(src.count) if len(src.window_of(r)["pieces"]) == 2]
    assert len(crossing) == 2 * (5 - 1)           # per boundary: windows of span 5
    w = src.window_of(crossing[0])
    assert [p[0].endswith(n) for p, n in zip(w["pieces"], ("era5_2000.nc", "era5_2001.nc"))
            ] == [True, True]
    rec = crossing[0]
    step = rec // src.batch_size
    got = src.rows(step, rec % 4, rec % 4 + 1)
    want = xarray_frames(files["nc"])[w["t0"]:w["t0"] + 5]
    assert np.array_equal(got["input"][0], np.concatenate([want[0], want[1]], -1))
    assert np.array_equal(got["target"][0], np.concatenate(list(want[2:]), -1))
    assert src.count == 1096 - 5 + 1              # no window lost at a file's end


def test_legacy_cds_netcdf3_files_decode_like_xarray_and_windows_cross_them(tmp_path):
    """ERA5 as the Climate Data Store wrote it before 2024 (NetCDF3 64-bit offset, unlimited
    time, every variable packed into int16; written by netCDF-C through xarray): read
    without conversion, decoded as xarray decodes it (NaN over land included), and windows
    cross the yearly files as with NetCDF4."""
    paths = write_era5_years(tmp_path / "cds", (2000, 2001), zlib_year=None, sst=True,
                             legacy_cds=True)
    assert detect_format(paths[0]) == "netcdf3"
    variables = [*VARIABLES, "sst"]
    src = source(tmp_path / "cds", variables, steps=(2, 3), time_range=(None, None),
                 mask=True, nan="mask")
    for k, path in enumerate(paths):
        ds = xr.open_dataset(path).load()
        assert ds["t2m"].encoding["dtype"] == np.int16 and ds["sst"].isnull().any()
        for c in parse_channels(variables):
            want = ds[c.variable]
            want = (want if c.level is None else want.sel(level=int(c.level))).values
            got = src.read_channel(k, c, 0, ds.sizes["time"])
            assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True), c
    crossing = [r for r in range(src.count) if len(src.window_of(r)["pieces"]) == 2]
    assert len(crossing) == 5 - 1 and src.count == 366 + 365 - 5 + 1
    rec = crossing[0]
    w, got = src.window_of(rec), src.rows(rec // 4, rec % 4, rec % 4 + 1)
    want = xarray_frames(paths, variables)[w["t0"]:w["t0"] + 5]
    assert np.array_equal(got["target"][0], np.nan_to_num(np.concatenate(list(want[2:]), -1)))
    assert np.array_equal(got["mask"][0], ~np.isnan(np.concatenate(list(want[2:]), -1)))
    cdf5 = tmp_path / "cdf5"                    # CDF5: refused with the conversion
    cdf5.mkdir()
    netCDF4.Dataset(cdf5 / "era5_2000.nc", "w", format="NETCDF3_64BIT_DATA").close()
    with pytest.raises(ArrayDataError) as e:
        source(cdf5, time_range=(None, None)).check()
    assert "CDF5" in one_line(e) and "nccopy -k nc4" in str(e.value)


def test_a_damaged_chunk_is_named_with_file_variable_and_times(tmp_path):
    """A zlib chunk that no longer inflates (a bad block on disk) fails the read in one line
    naming the file, the variable and the time indices; the file is left as it is."""
    import h5py

    paths = write_era5_years(tmp_path / "nc", (2000, 2001), zlib_year=2001)
    with h5py.File(paths[1], "r") as f:
        chunk = f["t2m"].id.get_chunk_info(0)
    data = bytearray(paths[1].read_bytes())
    middle = chunk.byte_offset + chunk.size // 2
    data[middle:middle + 16] = bytes(16)
    paths[1].write_bytes(bytes(data))
    src = source(tmp_path / "nc", time_range=(None, None))
    with pytest.raises(ArrayDataError) as e:
        src.rows(366 // 4, 0, 4)                  # windows in the first days of 2001
    msg = one_line(e)
    assert str(paths[1]) in msg and "'t2m'" in msg and "time index 0.." in msg, msg
    assert "truncated or corrupt" in msg, msg
    assert paths[1].read_bytes() == bytes(data)   # left as it is


def test_rows_pickle_threads_and_shuffle(files):
    """The seeded order is a permutation of the windows; rows are the same read from two
    threads at once and from a pickled copy (which reopens the files)."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    src = source(files["root"] / "nc", steps=(2, 1), time_range=(None, END_2001),
                 shuffle=True, seed=3, shuffle_block=16)
    order = src.index.records(range(src.count)).tolist()     # one epoch
    assert sorted(order) == list(range(src.count)) and order != sorted(order)
    want = [src.rows(k, 0, 4) for k in range(6)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda k: src.rows(k, 0, 4), range(6)))
    copy = pickle.loads(pickle.dumps(src))
    for k in range(6):
        for name in ("input", "target"):
            assert np.array_equal(got[k][name], want[k][name])
            assert np.array_equal(copy.rows(k, 0, 4)[name], want[k][name])
    frames = xarray_frames(files["nc"])
    r = src.record_indices(0, 0, 1)[0]
    t0 = src.window_of(r)["t0"]
    assert np.array_equal(want[0]["input"][0], np.concatenate([frames[t0], frames[t0 + 1]], -1))
    assert src.reads_by_file and sum(src.reads_by_file.values()) >= 6 * 4


def test_a_dropped_source_frees_its_blocks_without_the_cycle_collector(files):
    """A source that read blocks is gone the moment nothing refers to it: no reference
    cycle (its file reader once held it through a closure), so its block cache is freed at
    once and the next source's blocks reuse that memory (a new source per epoch ran at
    0.6x when it lingered until a garbage collection)."""
    import gc
    import weakref

    src = source(files["root"] / "nc", time_range=(None, END_2001))
    src.rows(0, 0, 4)
    assert src._blocks, "the source read no block"
    gone = weakref.ref(src)
    was = gc.isenabled()
    gc.disable()
    try:
        src.close()
        del src
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        if was:
            gc.enable()


# --------------------------------------------------------------------- the silent cases


def test_time_gap_refused_or_never_spanned(files):
    gap_dir = files["gap"][0].parent
    with pytest.raises(ArrayDataError) as e:
        source(gap_dir).check()
    msg = one_line(e)
    assert all(s in msg for s in ("era5_2000.nc", "variable 'time'", "gap", "2000-07-12",
                                  "data.time_gaps: allow"))
    src = source(gap_dir, steps=(1, 2), time_gaps="allow")
    assert src.timeline.gaps and len(src.timeline.segments) == 2
    for r in range(src.count):
        times = src.window_of(r)["times"]
        assert np.all(np.diff(times) == np.timedelta64(1, "D")), r
    n = len(src.timeline.times)
    assert src.count == n - 2 * 2                 # each of the 2 segments loses span - 1


def test_reversed_latitude_refused_by_name_or_flipped(files):
    flip_dir = files["flip"][0].parent
    with pytest.raises(ArrayDataError) as e:
        source(flip_dir).check()
    msg = one_line(e)
    assert all(s in msg for s in ("era5_2001.nc", "'latitude'", "south to north", "-75",
                                  "data.latitude_order"))
    src = source(flip_dir, latitude_order="north_to_south")
    ref = xarray_frames([files["flip"][0]])       # 2000: north to south as written
    k = [str(f.path) for f in src.timeline.files].index(str(files["flip"][1]))
    year2001 = xr.open_dataset(files["flip"][1]).load()["t2m"].values
    assert year2001.shape[1] == 6 and not np.array_equal(src.read_channel(k, Channel("t2m"),
                                                                          0, 5), year2001[:5])
    assert np.array_equal(src.read_channel(k, Channel("t2m"), 0, 5), year2001[:5, ::-1])
    assert np.array_equal(src.rows(0, 0, 1)["input"][0], ref[0])


def test_level_dimension_taken_by_name(files):
    """WB2's (time, level, longitude, latitude): level is never time; a variable with a
    level dim needs its levels named, and a missing level is named."""
    with pytest.raises(ArrayDataError) as e:
        source(files["zarr"], ["geopotential"]).check()
    msg = one_line(e)
    assert "wb2.zarr" in msg and "'geopotential'" in msg and "level" in msg
    with pytest.raises(ArrayDataError) as e:
        source(files["zarr"], [{"geopotential": [500, 700]}]).check()
    msg = one_line(e)
    assert "level=700" in msg and str(list(LEVELS)) in msg
    src = source(files["zarr"], [{"geopotential": [850]}], time_range=(None, END_2001))
    assert src.count == 730 and src.frame[-1] == 1


def test_differing_grid_and_overlapping_files_refused(files, tmp_path):
    from tests.helpers.era5_files import dataset, times

    lat, lon = grid()
    d = tmp_path / "grid"
    d.mkdir()
    dataset(times((2000,)), lat, lon).to_netcdf(d / "a_2000.nc")
    dataset(times((2001,)), lat, lon + 1.0).to_netcdf(d / "b_2001.nc")
    with pytest.raises(ArrayDataError) as e:
        source(d, ["t2m"]).check()
    msg = one_line(e)
    assert "b_2001.nc" in msg and "'longitude'[0]=1" in msg
    o = tmp_path / "overlap"
    o.mkdir()
    dataset(times((2000,)), lat, lon).to_netcdf(o / "a.nc")
    dataset(times((2000,))[100:], lat, lon).to_netcdf(o / "b.nc")
    with pytest.raises(ArrayDataError) as e:
        source(o, ["t2m"]).check()
    assert "overlap" in one_line(e) and "b.nc" in str(e.value)


def test_new_cds_names_and_an_irregular_step(tmp_path):
    """ERA5's newer names (valid_time, pressure_level) and lat/lon are found by name; a
    step that is not a whole number of steps is refused naming the file and the time."""
    from tests.helpers.era5_files import dataset, times

    lat, lon = grid()
    d = tmp_path / "cds"
    d.mkdir()
    ds = dataset(times((2000,))[:40], lat, lon).rename(
        time="valid_time", level="pressure_level", latitude="lat", longitude="lon")
    ds.to_netcdf(d / "a.nc")
    src = source(d, ["t2m", {"geopotential": [850]}], constants=("latitude",))
    assert src.count == 39 and src.frame == (6, 12, 2)
    want = ds["geopotential"].sel(pressure_level=850).values[:2]
    assert np.array_equal(src.rows(0, 0, 1)["target"][0, ..., 1], want[1])
    odd = tmp_path / "odd"
    odd.mkdir()
    t = times((2000,))[:40].copy()
    t[20:] += np.timedelta64(6, "h")
    dataset(t, lat, lon).to_netcdf(odd / "a.nc")
    with pytest.raises(ArrayDataError) as e:
        source(odd, ["t2m"]).check()
    msg = one_line(e)
    assert all(s in msg for s in ("a.nc", "variable 'time'", "irregularly", "time[20]",
                                  "2000-01-21T06:00", "step is 24 h"))


def test_layout_warning_names_the_rechunk_command(files, monkeypatch):
    """A time chunk longer than a read block (netCDF's default chunks of a large grid) is
    named by `spmd data info` with the command that rechunks; contiguous files are not."""
    from spmd.data.sources import gridded_windows

    assert source(files["root"] / "nc", time_range=(None, END_2001)).layout_warnings() == []
    monkeypatch.setattr(gridded_windows, "BLOCK_BYTES", 32 * 1024)     # as for a large grid
    monkeypatch.setattr(gridded_windows, "MAX_BLOCK_BYTES", 32 * 1024)
    src = source(files["root"] / "nc", time_range=(None, END_2001))
    warnings = src.layout_warnings()
    assert src.block_rows < 365 and len(warnings) == len(VARIABLES)
    assert "era5_2001.nc" in warnings[0] and "nccopy -c time/1,latitude/6,longitude/12" in \
        warnings[0]
    assert "warning: file" in src.describe()
    ds = xr.open_dataset(files["nc"][1]).load()             # the values do not change
    assert np.array_equal(src.read_channel(1, Channel("t2m"), 0, 365), ds["t2m"].values)
    got = src.rows(0, 0, 4)["input"]
    assert np.array_equal(got, xarray_frames(files["nc"])[:4])


def test_nan_error_names_file_variable_and_time(files):
    sst_dir = files["sst"][0].parent
    with pytest.raises(ArrayDataError) as e:
        source(sst_dir, ["sst"]).rows(0, 0, 4)
    msg = one_line(e)
    assert all(s in msg for s in ("era5_2000.nc", "variable 'sst'", "time index 0",
                                  "2000-01-01", "data.nan: mask"))
    src = source(sst_dir, ["t2m"], time_range=(np.datetime64("2001-02-01", "ns"), None))
    rec = 9                                       # window of 2001-02-10 (index 40), t0 = 9
    with pytest.raises(ArrayDataError) as e:
        src.rows(rec // 4, rec % 4, rec % 4 + 1)
    msg = one_line(e)
    assert all(s in msg for s in ("era5_2001.nc", "'t2m'", "time index 40", "2001-02-10"))


def test_nan_mask_and_fill(files):
    sst_dir = files["sst"][0].parent
    lat, lon = grid()
    masked = source(sst_dir, ["sst", "t2m"], mask=True, nan="mask", nan_fill=-1.0,
                    time_range=(None, np.datetime64("2000-12-31", "ns")))
    got = masked.rows(0, 0, 4)
    sea = ~land(lat, lon)
    assert np.all(got["mask"][:, sea, 0] == 1) and np.all(got["mask"][:, ~sea, 0] == 0)
    assert np.all(got["mask"][..., 1] == 1)
    assert np.all(got["input"][:, ~sea, 0] == -1.0) and np.isfinite(got["input"]).all()
    filled = source(sst_dir, ["sst"], nan="fill",
                    time_range=(None, np.datetime64("2000-12-31", "ns"))).rows(0, 0, 4)
    assert np.all(filled["target"][:, ~sea, 0] == 0.0)
    stats = masked.channel_statistics()
    days = 366
    assert stats["count"][0] == days * sea.sum() and stats["count"][1] == days * sea.size
    want = xr.open_dataset(files["sst"][0])["sst"].values
    assert np.isclose(stats["mean"][0], np.nanmean(want.astype(np.float64)))


def test_constants_are_extra_input_channels(files):
    src = source(files["root"] / "nc", ["t2m"], constants=("lsm", "latitude"),
                 time_range=(None, END_2001))
    x = src.rows(0, 0, 2)["input"]
    lat, lon = grid()
    assert x.shape[-1] == 3
    assert np.array_equal(x[0, ..., 1], land(lat, lon).astype(np.float32))
    assert np.array_equal(x[1, :, 0, 2], lat.astype(np.float32))
    with pytest.raises(ArrayDataError, match=r"constant 'u10' \(data.constants\)"):
        source(files["root"] / "nc", ["t2m"], constants=("u10",),
               time_range=(None, END_2001)).check()


# --------------------------------------------------------------------- splits


def test_splits_overlap_identical_and_missing():
    with pytest.raises(ArrayDataError) as e:
        check_splits({"train": {"start": "2000-01-01", "end": "2001-12-31"},
                      "test": {"start": "2001-06-01", "end": "2002-12-31"}})
    assert "overlap" in one_line(e) and "data.allow_split_overlap" in str(e.value)
    assert check_splits({"train": {"end": "2001-12-31"}, "test": {"start": "2001-06-01"}},
                        allow_overlap=True)["test"][0] == np.datetime64("2001-06-01", "ns")
    with pytest.raises(ArrayDataError, match="same range"):
        check_splits({"train": {"start": "2000-01-01"}, "test": {"start": "2000-01-01"}},
                     allow_overlap=True)
    with pytest.raises(ArrayDataError, match=r"data.splits is not set.*never the train"):
        split_range(None, "test")
    cfg = DataConfig(variables=VARIABLES, splits={"train": {"end": "2001-12-31"}})
    with pytest.raises(ArrayDataError, match=r"data.splits.test is not set"):
        split_range({k: v.model_dump() for k, v in cfg.splits.items()}, "test")


def test_an_end_written_as_a_date_is_its_whole_day_as_in_xarray(tmp_path):
    """`end: 2000-03-24` holds every step of that day, as xarray's sel(time=slice(None,
    "2000-03-24")) does (issue 49); a month or an hour written likewise; a YAML date too."""
    import datetime

    paths = write_era5_years(tmp_path / "six_hourly", (2000,), step_hours=6, zlib_year=None)
    ds = xr.open_dataset(paths[0])
    for end in ("2000-03-24", "2000-03", "2000-03-24T06", datetime.date(2000, 3, 24)):
        steps = ds.sel(time=slice(None, str(end))).sizes["time"]
        splits = {"train": {"end": end}, "test": {"start": "2000-06-01"}}
        src = source(tmp_path / "six_hourly", time_range=split_range(splits, "train"))
        assert src.count == steps - 1, end                    # windows of 2 steps
        assert src.window_of(src.count - 1)["times"][-1] == ds["time"].values[steps - 1]
        assert src.covered_text() == (f"2000-01-01T00:00 .. "
                                      f"{np.datetime_as_string(ds['time'].values[steps - 1], 'm')}")
    assert steps == 4 * (31 + 29 + 23) + 4                    # all of 24 March, 6-hourly
    with pytest.raises(ArrayDataError, match="overlap"):      # the train day holds 12:00
        check_splits({"train": {"end": "2000-03-24"}, "test": {"start": "2000-03-24T12:00"}})


def test_data_info_says_what_it_knows_of_nan(tmp_path):
    """`spmd data info` (the source's describe) does not read every frame: it says so, and
    once `spmd data stats` stored the split's statistics, it names the channels with missing
    values and what data.nan: error will do with them (issue 49)."""
    from spmd.data.stats.normalization import data_fingerprint, write_statistics

    write_era5_years(tmp_path / "sst", (2000,), zlib_year=None, sst=True)
    src = source(tmp_path / "sst", ["t2m", "sst"], nan="error", time_range=(None, None))
    assert "data.nan: error; NaN not scanned (`spmd data stats CONFIG`" in src.describe()
    write_statistics(src.path, src.statistics_part(), split="train",
                     fingerprint=data_fingerprint(src.path, src.where), where=src.where,
                     channel_names={src.statistics_key(): ["t2m", "sst"]})
    text = src.describe()
    over_land = 366 * int(land(*grid()).sum())
    assert "NaN in this split's statistics" in text and f": sst {over_land};" in text, text
    assert "set data.nan to mask or fill" in text


def test_one_path_without_split_groups_is_not_test_equals_train(tmp_path):
    from spmd.data.data_config import SourceSections
    from spmd.data.sources.windows import WindowSource

    cfg = SourceSections(DataConfig(path=tmp_path / "x.h5", fields={"u": "w"},
                                    window=WindowConfig()), batch_size=2)
    fields = {n: BatchField((4, 1), np.float32, ("batch", "x", "channels")) for n in "uv"}
    kw = {"input_name": "u", "target_name": "v", "shuffle": False}
    WindowSource.from_sections(cfg, "train", fields, "{split}/w", **kw)     # train reads "w"
    with pytest.raises(ArrayDataError) as e:
        WindowSource.from_sections(cfg, "test", fields, "{split}/w", **kw)
    assert "data.fields.u=w has no {split}" in one_line(e)
    gridded = dataclasses.replace(cfg, data=cfg.data.model_copy(update={"variables": ["w"]}))
    with pytest.raises(ArrayDataError, match="data.variables is set, but the task"):
        WindowSource.from_sections(gridded, "train", fields, "{split}/w", **kw)


def test_task_loss_is_latitude_weighted_and_masked(files, tmp_path):
    """GriddedTrajectoryTask's loss on a batch with NaN over land: the mean of the squared
    error over sea points only, weighted by cos(latitude) (NumPy reference)."""
    from flax import nnx

    from spmd.config.load import build_task, load_config
    from tests.helpers.weather_task import TinyWeatherTask

    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(run=tmp_path / "run", data=files["sst"][0].parent))
    task = build_task(load_config(config, ["data.normalize=false"], task=TinyWeatherTask))
    assert task.frame_shape() == (6, 12, 4) and task.input_channels() == 6
    assert task.channel_names()[0] == "sst" and task.dt() == 24.0
    batch = task.train_source().rows(0, 0, 8)
    model = task.build_model(nnx.Rngs(0))
    loss, _ = task.loss(model, batch)
    pred = np.asarray(model(batch["input"]))
    w = np.cos(np.deg2rad(task.latitudes()))[None, :, None, None] / np.cos(
        np.deg2rad(task.latitudes())).mean() * batch["target_mask"]
    want = ((pred - batch["target"]) ** 2 * w).sum() / w.sum()
    assert np.isclose(float(loss), want, rtol=1e-5)
    sea = ~land(*grid())
    assert batch["target_mask"][:, ~sea, 0].sum() == 0 and batch["target_mask"][:, sea].all()


# --------------------------------------------------------------------- end to end

CONFIG = """\
task: tests.helpers.weather_task:TinyWeatherTask
run: {{dir: {run}, log_every: 1, progress: false}}
model: {{rollout_steps: 2}}
train: {{steps: 6, batch_size: 8, eval_every: 3}}
optimizer: {{lr: 1.0e-3}}
data:
  source: netcdf
  path: {data}
  variables: [sst, t2m, {{geopotential: [500, 850]}}]
  constants: [lsm, latitude]
  splits: {{train: {{end: 2000-12-31}}, test: {{start: 2001-01-01}}}}
  nan: mask
  normalize: true
  eval_batches: 2
  window: {{input_steps: 1, target_steps: 1, stride: 1}}
checkpoint: {{every: 3, persistent_every: 3}}
"""


# The 2-rank data.nan: mask run (`spmd data info`, `data stats`, `run -n 2`) is part of the
# weather flagship's one end-to-end run: tests/unit/tasks/test_weather_eval.py.


def test_stored_array_windows_refuse_level_as_time(files):
    """WindowSource (windows of stored arrays, positional axes) refuses a WB2 variable whose
    level would be read as time (a CF-packed one is decoded:
    tests/unit/data/cf/test_arrays_cf.py)."""
    from spmd.data.sources.windows import WindowSource

    def windows(path, dataset, frame):
        fields = {n: BatchField(frame, np.float32, AXES[:len(frame) + 1]) for n in "uv"}
        return WindowSource(path, dataset, fields, 2, input_name="u", target_name="v")

    with pytest.raises(ArrayDataError) as e:
        windows(files["zarr"], "geopotential", (12, 6, 1)).check()
    msg = one_line(e)
    assert "'geopotential'" in msg and "read 'level' as the trajectory or time" in msg
    plain = windows(files["root"] / "nc", "t2m", (6, 12, 1))   # a plain variable: as before,
    assert plain.count == 1096 - 3                              # no window across files


def test_a_missing_file_is_named_missing_not_truncated(tmp_path):
    from spmd.data.cf.gridded_timeline import scan_file

    with pytest.raises(ArrayDataError) as e:
        scan_file(tmp_path / "absent.nc", "data.path")
    assert "absent.nc does not exist (moved or deleted" in str(e.value)
    assert "truncated" not in str(e.value)


# ------------------------------------------------- monthly and yearly means (issue 49, item 6)


def monthly_sst(path, months: np.ndarray, stamp: str = "middle") -> None:
    """Monthly mean sea-surface temperature as CMIP and ERSST write it, by xarray: stamped at
    each month's middle (or first day), float32, land as _FillValue."""
    lat, lon = grid()
    starts = months.astype("datetime64[M]")
    if stamp == "middle":
        ends = starts + np.timedelta64(1, "M")
        times = (starts.astype("datetime64[s]")
                 + (ends.astype("datetime64[s]") - starts.astype("datetime64[s]")) // 2)
    else:
        times = starts.astype("datetime64[s]")
    rng = np.random.default_rng(len(months))
    sst = (290 + rng.standard_normal((len(times), len(lat), len(lon)))).astype(np.float32)
    sst[:, land(lat, lon)] = np.nan
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), sst, {"units": "K"})},
                    coords={"time": times, "lat": lat, "lon": lon})
    ds.to_netcdf(path, encoding={"sst": {"_FillValue": 1e20},
                                 "time": {"units": "hours since 1850-01-01"}})


@pytest.mark.parametrize("stamp", ["middle", "first"])
def test_monthly_means_are_regular_in_calendar_months(tmp_path, stamp):
    months = np.arange("1990-01", "1993-01", dtype="datetime64[M]")
    monthly_sst(tmp_path / "sst_mon.nc", months, stamp)
    src = source(tmp_path / "sst_mon.nc", ["sst"], nan="mask", mask=True,
                 time_range=(None, None))
    assert src.count == 36 - 1                              # windows of 2 months
    assert "36 times" in src.describe() and "every 1 month" in src.describe()
    with xr.open_dataset(tmp_path / "sst_mon.nc") as ds:
        want = ds["sst"].values                             # NaN over land, as xarray reads
    rows = src.rows(0, 0, 4)
    np.testing.assert_array_equal(np.isnan(want[1]), rows["mask"][1, ..., 0] == 0)
    sea = ~land(*grid())
    np.testing.assert_allclose(rows["target"][1, ..., 0][sea], want[2][sea])


def test_a_missing_month_is_a_gap_and_yearly_means_step_in_years(tmp_path):
    months = np.arange("1990-01", "1992-01", dtype="datetime64[M]")
    monthly_sst(tmp_path / "gap.nc", np.delete(months, 7))            # no August 1990
    with pytest.raises(ArrayDataError) as e:
        source(tmp_path / "gap.nc", ["sst"], nan="mask", mask=True,
               time_range=(None, None)).check()
    assert "has a gap at time[7]=1990-09-16T00:00 (previous time 1990-07-16T12:00, step 1 " \
           "month)" in str(e.value)
    allowed = source(tmp_path / "gap.nc", ["sst"], nan="mask", mask=True,
                     time_range=(None, None), time_gaps="allow")
    assert allowed.count == (7 - 1) + (16 - 1)                        # no window spans it
    years = np.arange("1950", "1980", dtype="datetime64[Y]").astype("datetime64[M]")
    monthly_sst(tmp_path / "annual.nc", years, "first")
    src = source(tmp_path / "annual.nc", ["sst"], nan="mask", mask=True,
                 time_range=(None, None))
    assert src.count == 30 - 1 and "every 1 year" in src.describe()
