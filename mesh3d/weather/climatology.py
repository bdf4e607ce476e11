"""The climatology that ACC's anomalies are taken from, one field per channel, read block by block.

Usage::

    clim = open_climatology("clim.nc")                  # {"z500": DataArray (lat, lon), "t2m": ..., ...}, lazily
    check_climatology(clim, ["z500", "t2m"], lat, lon)     # every rank, before any collective: raises naming the fault
    block = climatology_block(clim, ["z500", "t2m"], (0, 91), (0, 180))   # (C, h, w) fp64, this rank's block

A file holds one variable per channel, named as the forecast store's channels (``z500``, ``t2m``: what ``mesh3d
forecast`` writes), each a (latitude, longitude) field on the store's grid or a single value; or one variable with a
``channel`` dimension whose labels are those names. Nothing is read but each rank's block.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["check_climatology", "climatology_block", "open_climatology"]


def open_climatology(path: str | os.PathLike) -> dict[str, Any]:
    """The climatology file at ``path`` (zarr or NetCDF) as ``{channel name: field}``, nothing read yet.

    Usage: ``score_forecast("fc.zarr", climatology=open_climatology("clim.nc"))``
    """
    import xarray as xr  # noqa: PLC0415 (optional: the weather extra)

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"climatology {path!r} does not exist: give a zarr store or NetCDF file holding one "
                                "variable per channel of the forecast (z500, t2m, ...)")
    ds = xr.open_zarr(path, consolidated=None) if os.path.isdir(path) else xr.open_dataset(path)
    with_channels = [name for name, var in ds.data_vars.items() if "channel" in var.dims]
    if len(with_channels) == 1:
        var = ds[with_channels[0]]
        return {str(label): var.sel(channel=label) for label in var["channel"].values}
    return {str(name): var for name, var in ds.data_vars.items()}


def check_climatology(climatology: Mapping[str, Any], channels: Sequence[str], lat: np.ndarray, lon: np.ndarray) -> None:
    """Raise a ValueError naming what is wrong unless ``climatology`` has every channel, each a field on the grid
    ``lat`` x ``lon`` (its coordinates, where it has them, equal to these) or one value. Reads metadata and coordinates
    only (call it on every rank before any collective).

    Usage: ``check_climatology(open_climatology(path), [c.name for c in spec.channels], spec.lat, spec.lon)``
    """
    missing = [c for c in channels if c not in climatology]
    if missing:
        raise ValueError(f"the climatology lacks channels {missing} (it has {sorted(climatology)}): give one variable "
                         "per channel of the forecast store, named as its channels")
    shape = (len(lat), len(lon))
    for name in channels:
        field = climatology[name]
        got = tuple(np.shape(field))
        if got in ((), (1,)):
            continue
        if got != shape:
            raise ValueError(f"the climatology's {name} has shape {got}: give a {shape[0]} x {shape[1]} (latitude, "
                             "longitude) field on the forecast's grid, or a single value")
        for dim, want, what in zip(getattr(field, "dims", ()), (lat, lon), ("latitude", "longitude")):
            values = field.coords[dim].values if dim in getattr(field, "coords", {}) else None
            if values is not None and not np.allclose(np.asarray(values, dtype=np.float64), want):
                raise ValueError(f"the climatology's {name} has {what}s {values[0]:g}..{values[-1]:g}, the forecast's "
                                 f"run {want[0]:g}..{want[-1]:g}: give it on the forecast's grid, in its order")


def climatology_block(climatology: Mapping[str, Any], channels: Sequence[str], rows: tuple[int, int],
                      cols: tuple[int, int]) -> np.ndarray:
    """``(C, h, w)`` (or ``(C, 1, 1)`` where a channel is one value) fp64: rows and columns of each channel's field.

    Usage: ``clim = climatology_block(clim, names, blocks.rows, blocks.cols)``
    """
    (r0, r1), (c0, c1) = rows, cols
    out = np.empty((len(channels), r1 - r0, c1 - c0))
    for k, name in enumerate(channels):
        field = climatology[name]
        if np.ndim(field) < 2:
            out[k] = float(np.asarray(field).reshape(-1)[0])
        elif hasattr(field, "isel"):                                          # an xarray.DataArray: this block only
            lat, lon = field.dims
            out[k] = np.asarray(field.isel({lat: slice(r0, r1), lon: slice(c0, c1)}).values, dtype=np.float64)
        else:
            out[k] = np.asarray(field, dtype=np.float64)[r0:r1, c0:c1]
    return out
