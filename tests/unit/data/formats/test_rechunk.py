"""`spmd data rechunk IN OUT` (spmd.data.formats.rechunk): xarray-written NetCDF4 files and a Zarr
store rewritten with chunks of one time step; decoded values and CF packing unchanged, and
the layout warning of `spmd data info` gone."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import xarray as xr

from spmd.data.formats.rechunk import rechunk
from spmd.data.formats.stores import ArrayDataError
from tests.helpers.env import REPO, clean_env
from tests.helpers.era5_files import write_era5_years, write_wb2_zarr


def test_netcdf_directory_is_rechunked_by_the_cli_with_values_and_packing_kept(tmp_path):
    src = tmp_path / "nc"
    paths = write_era5_years(src, (2000, 2001), zlib_year=2001)
    out = tmp_path / "nc1"
    proc = subprocess.run([sys.executable, "-m", "spmd.cli", "data", "rechunk", str(src),
                           str(out)], capture_output=True, text=True, cwd=REPO,
                          env=clean_env(compile_cache=False), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == [str(out / p.name) for p in paths]
    for p in paths:
        with h5py.File(out / p.name, "r") as f:
            assert f["t2m"].chunks == (1, 6, 12) and f["t2m"].compression == "gzip"
            assert f["geopotential"].chunks == (1, 3, 6, 12)
            assert f["u10"].dtype == np.int16 and "scale_factor" in f["u10"].attrs
        a, b = xr.open_dataset(p).load(), xr.open_dataset(out / p.name).load()
        for name in a.data_vars:
            np.testing.assert_array_equal(a[name].values, b[name].values)
        assert (a["time"].values == b["time"].values).all()
    with pytest.raises(ArrayDataError, match="exists; give a new path"):
        rechunk(src, out)


def test_legacy_cds_netcdf3_files_are_rewritten_as_chunked_netcdf4(tmp_path):
    """NetCDF3 files (the CDS before 2024) go through the same command: the output is
    NetCDF4 with chunks of one step, the int16 packing and the decoded values kept."""
    paths = write_era5_years(tmp_path / "cds", (2000,), zlib_year=None, legacy_cds=True)
    out = tmp_path / "nc4"
    assert rechunk(tmp_path / "cds", out) == [out / paths[0].name]
    a, b = xr.open_dataset(paths[0]).load(), xr.open_dataset(out / paths[0].name).load()
    assert b["t2m"].encoding["dtype"] == np.int16 and b["t2m"].encoding["chunksizes"] == (1, 6, 12)
    for name in a.data_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values)
    with h5py.File(out / paths[0].name) as f:          # NetCDF4 is HDF5
        assert f["t2m"].chunks == (1, 6, 12)


def test_zarr_store_is_rechunked_and_the_layout_warning_goes(tmp_path, monkeypatch):
    from spmd.data.batch import BatchField
    from spmd.data.cf.channels import parse_channels
    from spmd.data.sources import gridded_windows

    store = write_wb2_zarr(tmp_path / "wb2.zarr", (2000,), time_chunk=64)
    out = tmp_path / "wb2_t1.zarr"
    assert rechunk(store, out) == [out]
    a = xr.open_zarr(store, consolidated=False).load()
    b = xr.open_zarr(out, consolidated=False).load()
    assert b["t2m"].encoding["chunks"] == (1, 12, 6)
    np.testing.assert_array_equal(a["u10"].values, b["u10"].values)

    monkeypatch.setattr(gridded_windows, "BLOCK_BYTES", 2048)      # as for a large grid
    monkeypatch.setattr(gridded_windows, "MAX_BLOCK_BYTES", 2048)
    axes = ("batch", "x", "y", "channels")
    fields = {n: BatchField((6, 12, 1), np.float32, axes) for n in ("input", "target")}

    def warnings(path):
        src = gridded_windows.GriddedWindowSource(
            path, parse_channels(["t2m"]), fields, 4, input_name="input",
            target_name="target", shuffle=False)
        try:
            return src.layout_warnings()
        finally:
            src.close()

    before = warnings(store)
    assert len(before) == 1 and "spmd data rechunk" in before[0]
    assert warnings(out) == []
