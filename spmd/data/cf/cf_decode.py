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
tests/unit/data/sources/test_weather_data.py). `_Unsigned` (netCDF's unsigned-as-signed hack)
is refused with the variable named.

`stored_coding` gives the Coding of a stored array that the readers of plain arrays
(spmd.data.sources.arrays.ArraySource, spmd.data.sources.windows.WindowSource, the statistics of
spmd.data.stats.normalization) decode: its attributes are looked at first (cheap), and only a
variable that carries CF coding (`scale_factor`, `add_offset`, a non-NaN `_FillValue` or
`missing_value`) is opened with xarray, once, for xarray's view of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spmd.data.formats.stores import XARRAY_ENGINES, ArrayDataError, open_xarray

__all__ = ["CF_FORMATS", "Coding", "coding_of", "decode", "has_cf_coding", "stored_coding"]

CF_FORMATS = tuple(XARRAY_ENGINES)   # stores whose variables may carry CF attributes


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


def _fill_value(value: Any) -> float | None:
    """A CF fill value attribute as a number, or None when absent or NaN (NaN reads as
    missing anyway). Zarr v3 attributes written by xarray hold it base64-encoded."""
    if value is None:
        return None
    if isinstance(value, str):
        import base64

        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            return None
        if len(raw) != 8:                   # xarray's encoding of a float fill value
            return None
        value = np.frombuffer(raw, np.float64)[0]
    try:
        number = float(np.ravel(value)[0])
    except (TypeError, ValueError, IndexError):
        return None
    return None if np.isnan(number) else number


def has_cf_coding(attrs: Any) -> bool:
    """Whether a stored array's attributes (as h5py / h5netcdf / zarr give them) ask for CF
    decoding: `scale_factor`, `add_offset`, `_Unsigned`, or a non-NaN `_FillValue` /
    `missing_value`."""
    attrs = dict(attrs or {})
    if {"scale_factor", "add_offset", "_Unsigned"} & set(attrs):
        return True
    return any(_fill_value(attrs.get(k)) is not None for k in ("_FillValue", "missing_value"))


def stored_coding(path: Any, fmt: str, dataset: str, attrs: Any, where: str) -> Coding | None:
    """The Coding of array `dataset` (a path in the store, e.g. "train/u": group "train",
    variable "u") of the NetCDF4 file or Zarr store at `path`, as xarray decodes it; None
    when it needs no decoding (no CF attributes in `attrs`, its attributes as the store
    gives them, or another format). Opens the file with xarray only when `attrs` carry CF
    coding. Raises ArrayDataError (naming `where` and the variable) when xarray cannot read
    it or it uses `_Unsigned`."""
    if fmt not in CF_FORMATS or not has_cf_coding(attrs):
        return None
    group, _, name = str(dataset).strip("/").rpartition("/")
    try:
        ds = open_xarray(path, fmt, group=group or None, decode_times=False,
                         decode_timedelta=False)
        with ds:
            if name not in ds.variables:
                raise KeyError(name)
            coding = coding_of(ds.variables[name], where, dataset)
    except ArrayDataError:
        raise
    except Exception as e:     # xarray's backends raise many kinds
        raise ArrayDataError(f"{where}: variable '{dataset}' carries CF attributes "
                             f"({sorted(dict(attrs))}) but xarray cannot open it to decode "
                             f"them ({type(e).__name__}: {e}); rewrite it unpacked "
                             f"(xarray: encoding dtype float32)") from None
    return None if coding.identity else coding
