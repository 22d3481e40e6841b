"""CF decoding of raw blocks, in NumPy, exactly as xarray decodes them.

Why: a weather variable is often stored packed (`int16` with `scale_factor` and
`add_offset`) and with a `_FillValue` / `missing_value` for missing points. Reading the
raw values (h5py, h5netcdf, zarr) gives counts, not physical values. xarray decodes them,
but a per-sample xarray call is slow; so the file's metadata are read once with xarray
(`coding_of` takes what xarray found: the fill values, scale and offset as the backend
gave them, the decoded dtype), and each raw block is decoded here with the same steps as
xarray's `CFMaskCoder` and `CFScaleOffsetCoder`:

1. cast to the decoded dtype (xarray's choice: float32 for float32 / small ints, float64
   when `scale_factor` / `add_offset` are float64, ...), a copy;
2. every element equal to one of the encoded fill values (`_FillValue`, `missing_value`,
   NaN ones dropped) becomes NaN;
3. `data *= scale_factor`, then `data += add_offset`, in place, with the scalars of the
   types xarray holds (so float32 stays float32 with the same rounding).

The result equals `xarray.open_dataset(...)[name].values` element for element (tested in
tests/unit/test_weather_data.py). `_Unsigned` (netCDF's unsigned-as-signed hack) is refused
with the variable named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spmd.data.stores import ArrayDataError

__all__ = ["Coding", "coding_of", "decode"]


@dataclass(frozen=True)
class Coding:
    """How one variable's raw values become physical ones (from xarray's view of it)."""

    raw_dtype: np.dtype
    dtype: np.dtype                     # the decoded dtype (xarray's)
    fill_values: tuple[Any, ...]        # encoded values that mean "missing"
    scale_factor: Any = None            # as xarray holds them (type matters for rounding)
    add_offset: Any = None

    @property
    def identity(self) -> bool:
        """Raw values are the decoded values."""
        return (not self.fill_values and self.scale_factor is None and self.add_offset is None
                and self.raw_dtype == self.dtype)


def _scalar(value: Any) -> Any:
    """A one-element attribute as xarray uses it (`np.asarray(v).item()` when not 0-d)."""
    if value is None:
        return None
    return np.asarray(value).item() if np.ndim(value) > 0 else value


def coding_of(variable: Any, where: str, name: str) -> Coding:
    """The Coding of a variable of an xarray Dataset opened with CF decoding (its
    `.encoding` holds the raw dtype, fill values, scale and offset)."""
    enc = dict(variable.encoding)
    if "_Unsigned" in enc or "_Unsigned" in variable.attrs:
        raise ArrayDataError(f"{where}: variable '{name}' uses the _Unsigned attribute, which "
                             f"spmd does not decode; rewrite it as a signed or float variable "
                             f"(e.g. xarray: ds.to_netcdf with encoding dtype float32)")
    raw = np.dtype(enc.get("dtype", variable.dtype))
    fills: set = set()
    for key in ("missing_value", "_FillValue"):
        if enc.get(key) is not None:
            fills |= {v for v in np.ravel(enc[key]).tolist() if not _isnull(v)}
    return Coding(raw, np.dtype(variable.dtype), tuple(sorted(fills)),
                  _scalar(enc.get("scale_factor")), _scalar(enc.get("add_offset")))


def _isnull(value: Any) -> bool:
    try:
        return bool(np.isnan(value))
    except TypeError:
        return value is None


def decode(raw: np.ndarray, coding: Coding) -> np.ndarray:
    """The physical values of a raw block (a new array of `coding.dtype`)."""
    data = np.array(raw, dtype=coding.dtype, copy=True)
    if coding.fill_values:
        missing = np.zeros(data.shape, bool)
        for fv in coding.fill_values:      # compared after the cast, as xarray does
            missing |= data == fv
        data[missing] = np.nan
    if coding.scale_factor is not None:
        data *= coding.scale_factor
    if coding.add_offset is not None:
        data += coding.add_offset
    return data
