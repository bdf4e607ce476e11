"""A forecast store's fields: the model's channels as one variable per field, read and written as the model's blocks.

A channel is a variable at a pressure level, or a surface variable (``ChannelInfo``). The store keeps one array per
variable: ``(init_time, lead_time, member, latitude, longitude)`` for a surface field, with ``level`` before the
latitude for a field on pressure levels (the store's ``level`` coordinate: every level any field has, ascending).
(Those are the ``cf`` convention's names; an ``earth2studio`` store keeps one surface-like variable per channel,
``store_fields``; every reader here takes the names from the store's ``mesh3d_convention``.)
``FieldArrays`` writes and reads ``(member, channel, rows, cols)`` blocks in the model's channel order, each field's
channels in one call where their levels are one run; ``channels_array`` stacks an opened store back into one array.

Usage::

    levels, fields = field_layout(channels)          # raises ValueError for channels that are not fields
    arrays = FieldArrays.open("fc.zarr", channels); arrays.read(init, lead, (0, 8), (0, 16))   # (M, C, 8, 16)
    channels_array(xarray.open_zarr("fc.zarr")).sel(channel="z500")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from mesh3d.weather.conventions import CONVENTIONS, COORD_NAMES, StoreConvention, convention_of

__all__ = ["CHANNELS_ATTR", "FIELD_DIMS", "LEVEL_DIMS", "ChannelInfo", "FieldArrays", "channels_array", "field_layout",
           "store_channels", "store_fields"]

#: The dims of a surface field and of a field on pressure levels (the ``cf`` convention's).
FIELD_DIMS = CONVENTIONS["cf"].dims(leveled=False)
LEVEL_DIMS = CONVENTIONS["cf"].dims(leveled=True)
#: The store's attribute holding the model's channels in order: ``[[name, variable, level, units], ...]``.
CHANNELS_ATTR = "mesh3d_channels"


@dataclass(frozen=True)
class ChannelInfo:
    """A channel of the store: its name, variable, level (None for a surface field) and units.

    Usage: ``ChannelInfo("z500", "z", 500.0, "m")``
    """

    name: str
    variable: str
    level: float | None
    units: str


def field_layout(channels: tuple[ChannelInfo, ...]) -> tuple[list[float], dict[str, list[tuple[int, int | None]]]]:
    """The store's level coordinate (ascending) and, per field in order of first use, its channels as (channel index,
    level index or None). Raises ``ValueError`` for channels that cannot be stored as fields (a field with and without
    levels, one level twice, units that differ between a field's levels, a name the store's coordinates use)."""
    levels = sorted({c.level for c in channels if c.level is not None})
    fields: dict[str, list[tuple[int, int | None]]] = {}
    for i, c in enumerate(channels):
        if c.variable in COORD_NAMES or not c.variable or "/" in c.variable:
            raise ValueError(f"forecast store: channel {c.name!r}'s variable {c.variable!r} cannot be a field of the store "
                             f"(not empty, no '/', none of {', '.join(COORD_NAMES)})")
        taken = fields.setdefault(c.variable, [])
        first = channels[taken[0][0]] if taken else c
        if (first.level is None) != (c.level is None) or (taken and c.level is None):
            raise ValueError(f"forecast store: variable {c.variable!r} is channel {first.name!r} and {c.name!r}: a field "
                             "is either on pressure levels, each once, or a surface field, once")
        if first.units != c.units:
            raise ValueError(f"forecast store: variable {c.variable!r} has units {first.units!r} ({first.name}) and "
                             f"{c.units!r} ({c.name}); one field has one unit")
        level = None if c.level is None else levels.index(c.level)
        if level is not None and any(lv == level for _, lv in taken):
            raise ValueError(f"forecast store: variable {c.variable!r} at level {c.level:g} twice (channel {c.name!r})")
        taken.append((i, level))
    return levels, fields


def store_fields(channels: tuple[ChannelInfo, ...], convention: StoreConvention) -> tuple[ChannelInfo, ...]:
    """The channels as the store's variables hold them: as they are, or (a ``per_channel`` convention) each channel
    its own surface-like variable named as the channel (``z500``)."""
    if not convention.per_channel:
        return channels
    return tuple(ChannelInfo(c.name, c.name, None, c.units) for c in channels)


def store_channels(attrs: Any, path: str = "the store") -> tuple[ChannelInfo, ...]:
    """The model's channels in order, from a store's attributes (``mesh3d_channels``)."""
    if CHANNELS_ATTR not in attrs:
        raise ValueError(f"{path} is not a mesh3d forecast store of this version (no {CHANNELS_ATTR} attribute: a store "
                         "written before fields became variables holds one 'forecast' array); write a new store")
    return tuple(ChannelInfo(str(n), str(v), None if lv is None else float(lv), str(u))
                 for n, v, lv, u in json.loads(attrs[CHANNELS_ATTR]))


def channels_array(ds: Any) -> Any:
    """A store's fields (an ``xarray.Dataset`` from ``xarray.open_zarr``) as one ``xarray.DataArray`` in the model's
    channel order: ``(init_time, lead_time, member, channel, latitude, longitude)`` in the ``cf`` convention (the
    store's own names in another), ``channel`` the names.

    Usage: ``channels_array(xr.open_zarr("fc.zarr")).sel(channel="z500")``
    """
    import xarray as xr  # noqa: PLC0415 (optional: the weather extra)

    conv = convention_of(ds.attrs)
    channels = store_channels(ds.attrs)
    parts = [ds[c.variable] if c.level is None else ds[c.variable].sel({conv.level: c.level}, drop=True)
             for c in store_fields(channels, conv)]
    stacked = xr.concat([p.drop_attrs() for p in parts], dim="channel", coords="minimal", compat="override")
    stacked = stacked.assign_coords(channel=[c.name for c in channels])
    return stacked.transpose(conv.init, conv.lead, conv.member, "channel", conv.latitude, conv.longitude)


class FieldArrays:
    """The store's field arrays, read and written as the model's ``(member, channel, rows, cols)`` blocks.

    Usage: ``arrays = FieldArrays.open("fc.zarr", spec.channels); block = arrays.read(i, k, (0, 8), (0, 16))``
    """

    def __init__(self, root: Any, channels: tuple[ChannelInfo, ...]) -> None:
        _, fields = field_layout(store_fields(channels, convention_of(root.attrs)))
        # NOTE: per field, its channels in level order, and whether their levels are one run (one slice to write)
        self._fields = []
        for name, where in fields.items():
            where = sorted(where, key=lambda cl: -1 if cl[1] is None else cl[1])
            levels = [lv for _, lv in where]
            run = levels[0] is not None and levels == list(range(levels[0], levels[0] + len(levels)))
            self._fields.append((root[name], [c for c, _ in where], levels, run))
        self.channels = len(channels)
        self.dtype = np.dtype(self._fields[0][0].dtype)

    @classmethod
    def open(cls, path: str, channels: tuple[ChannelInfo, ...], mode: str = "r") -> FieldArrays:
        import zarr  # noqa: PLC0415 (optional: the weather extra)

        return cls(zarr.open_group(path, mode=mode, use_consolidated=False), channels)

    def write(self, init: int, lead: int, member: int, blocks: np.ndarray, rows: tuple[int, int],
              cols: tuple[int, int]) -> None:
        """``(n, C, h, w)`` blocks of members ``member .. member + n - 1``: each field's channels in one write where
        their levels are one run."""
        n, (r0, r1), (c0, c1) = blocks.shape[0], rows, cols
        for arr, chans, levels, run in self._fields:
            if levels[0] is None:
                arr[init, lead, member:member + n, r0:r1, c0:c1] = blocks[:, chans[0]]
            elif run:
                arr[init, lead, member:member + n, levels[0]:levels[-1] + 1, r0:r1, c0:c1] = blocks[:, chans]
            else:
                for c, lv in zip(chans, levels):
                    arr[init, lead, member:member + n, lv, r0:r1, c0:c1] = blocks[:, c]

    def read(self, init: int, lead: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """Every member's ``(M, C, h, w)`` block at (init, lead index)."""
        (r0, r1), (c0, c1) = rows, cols
        out: np.ndarray | None = None
        for arr, chans, levels, run in self._fields:
            if levels[0] is None:
                part = np.asarray(arr[init, lead, :, r0:r1, c0:c1])[:, None]
            elif run:
                part = np.asarray(arr[init, lead, :, levels[0]:levels[-1] + 1, r0:r1, c0:c1])
            else:
                part = np.stack([np.asarray(arr[init, lead, :, lv, r0:r1, c0:c1]) for lv in levels], axis=1)
            if out is None:
                out = np.empty((part.shape[0], self.channels, *part.shape[2:]), dtype=part.dtype)
            out[:, chans] = part
        assert out is not None
        return out
