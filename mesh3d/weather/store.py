"""The forecast store: one zarr v3 store with CF-style coordinates, written block by block, with a restart record.

One variable per field, as CF tools, WeatherBench 2 and earth2studio read them: ``t2m(init_time, lead_time, member,
latitude, longitude)`` for a surface field, ``z(init_time, lead_time, member, level, latitude, longitude)`` for one
on pressure levels, in physical units, each with ``units``, ``long_name`` and the CF ``standard_name`` where there
is one (``cf_names``). Coordinates: ``init_time`` (``forecast_reference_time``), ``lead_time`` (a timedelta,
``forecast_period``), ``valid_time`` (their sum), ``member`` (``realization``), ``level`` (hPa, every level any field
has; a field's levels it was not forecast on stay NaN and take no space) and ``latitude``/``longitude`` in degrees
north/east. These are the ``cf`` convention's names; ``StoreSpec.convention`` chooses WeatherBench 2's or
earth2studio's instead (``mesh3d.weather.conventions``), recorded in the attribute ``mesh3d_convention``.
The model's channels in its order (name, variable, level, units) are the attribute ``mesh3d_channels``;
``channels_array(ds)`` stacks them back into one ``(..., channel, latitude, longitude)`` array. A chunk is one
(init, lead, member, level) of one field, one tile of the globe. The tiles do not depend on the mesh, so every mesh
writes the same store.

While a run is under way the store also holds ``restart/``: per sample (``init * members + member``) the number of
leads written (``leads_done``) and the model's state at recent leads in its own dtype (``state``, three slots;
``state_lead`` says which lead each slot holds), so a killed run continues from the last lead written, exactly.
It is removed when the run completes, and the metadata is consolidated: ``xarray.open_zarr(path)`` opens it.

Usage::

    spec = StoreSpec(init_times, lead, 10, 8, channels, lat, lon, tile=(4, 8), dtype="float32", run={...})
    if dm.rank == 0: create_store("fc.zarr", spec)     # then a barrier; every rank opens it
    store = ForecastStore("fc.zarr")
    store.write(init=0, lead=3, member=5, block=y, rows=(0, 16), cols=(32, 64))
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mesh3d.weather.cf_names import cf_attrs
from mesh3d.weather.conventions import CONVENTION_ATTR, convention_of, store_convention
from mesh3d.weather.fields import CHANNELS_ATTR, ChannelInfo, FieldArrays, field_layout, store_channels, store_fields

__all__ = ["SLOTS", "ForecastStore", "StoreSpec", "create_store", "read_spec"]
#: Restart slots per sample: the one being written is never the latest recorded nor the one being recorded.
SLOTS = 3
RUN_ATTR = "mesh3d_forecast"
#: Run record entries that are where the inputs lie, not what they hold: a checkpoint or dataset moved elsewhere may
#: continue a store, their content checked instead ("weights": the model's weights; "source_digest": the dataset's).
MOVABLE = ("checkpoint", "source")
#: Compared only where both records hold it (a store written before it was recorded).
COMPARED_WHEN_BOTH = ("source_digest",)


@dataclass(frozen=True)
class StoreSpec:
    """Everything the store's metadata holds: coordinates, tiles, dtypes and the run that writes it.

    Usage: ``StoreSpec(inits, np.timedelta64(6, "h"), 10, 8, channels, lat, lon, (4, 8), "float32")``
    """

    init_times: tuple[np.datetime64, ...]
    lead: np.timedelta64
    leads: int
    members: int
    channels: tuple[ChannelInfo, ...]
    lat: np.ndarray = field(compare=False)
    lon: np.ndarray = field(compare=False)
    tile: tuple[int, int]
    dtype: str
    state_dtype: str = "float32"
    run: dict[str, Any] = field(default_factory=dict)
    #: zarr's default codec (zstd) for the fields; False: the bytes as they are (faster to write, larger).
    compress: bool = True
    #: how the store names its dims and variables (mesh3d.weather.conventions): cf, weatherbench2 or earth2studio
    convention: str = "cf"

    def __post_init__(self) -> None:
        # NOTE: checked where the spec is built, on every rank, before any collective
        field_layout(store_fields(self.channels, store_convention(self.convention)))

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.init_times), self.leads, self.members, len(self.channels), len(self.lat), len(self.lon))

    @property
    def samples(self) -> int:
        return len(self.init_times) * self.members

    def lead_times(self) -> np.ndarray:
        return (np.arange(1, self.leads + 1) * self.lead).astype("timedelta64[ns]")

    def differences(self, other: StoreSpec) -> list[str]:
        """What differs from ``other`` (the store's), each as ``"name: ours vs theirs"``."""
        out = []
        for name in ("leads", "members", "tile", "dtype", "convention"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: {getattr(self, name)} vs {getattr(other, name)}")
        if [str(t) for t in self.init_times] != [str(t) for t in other.init_times]:
            out.append(f"init times: {[str(t) for t in self.init_times]} vs {[str(t) for t in other.init_times]}")
        if np.timedelta64(self.lead, "ns") != np.timedelta64(other.lead, "ns"):
            out.append(f"lead: {hours(self.lead)} vs {hours(other.lead)}")
        if [c.name for c in self.channels] != [c.name for c in other.channels]:
            out.append(f"channels: {[c.name for c in self.channels]} vs {[c.name for c in other.channels]}")
        if self.lat.shape != other.lat.shape or self.lon.shape != other.lon.shape or not (
                np.array_equal(self.lat, other.lat) and np.array_equal(self.lon, other.lon)):
            out.append(f"grid: {self.lat.size} x {self.lon.size} vs {other.lat.size} x {other.lon.size} (or other values)")
        for key in sorted(set(self.run) | set(other.run)):
            if key in MOVABLE or (key in COMPARED_WHEN_BOTH and (key not in self.run or key not in other.run)):
                continue
            if self.run.get(key) != other.run.get(key):
                out.append(f"{key}: {self.run.get(key)!r} vs {other.run.get(key)!r}")
        return out


def hours(delta: Any) -> str:
    """A duration as hours: ``"6 h"``, ``"1.5 h"`` (not ``numpy.timedelta64(21600000000000,'ns')``)."""
    value = np.timedelta64(delta, "ns").astype(np.int64) / 3.6e12
    return f"{value:g} h"


def create_store(path: str | os.PathLike, spec: StoreSpec) -> None:
    """Create the store (one rank): coordinates, the NaN-filled ``forecast`` array and the restart record.

    Built beside ``path`` and renamed into place, so a store that exists is complete.
    """
    import xarray as xr  # noqa: PLC0415 (optional: the weather extra)
    import zarr  # noqa: PLC0415 (optional: the weather extra)

    path = os.fspath(path)
    # NOTE: one building folder per process: jobs writing members of one campaign may create the store at once
    building = f"{path}.creating-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    conv = store_convention(spec.convention)
    levels, fields = field_layout(store_fields(spec.channels, conv))
    inits = np.array(spec.init_times, dtype="datetime64[ns]")
    leads = spec.lead_times()
    coords = {
        conv.init: (conv.init, inits, {"standard_name": "forecast_reference_time", "long_name": "initial time"}),
        conv.lead: (conv.lead, leads, {"standard_name": "forecast_period", "long_name": "lead time"}),
        "valid_time": ((conv.init, conv.lead), inits[:, None] + leads[None, :], {"standard_name": "time"}),
        conv.member: (conv.member, np.arange(spec.members),
                      {"standard_name": "realization", "long_name": "ensemble member"}),
        conv.latitude: (conv.latitude, np.asarray(spec.lat, dtype=np.float64),
                        {"units": "degrees_north", "standard_name": "latitude", "axis": "Y"}),
        conv.longitude: (conv.longitude, np.asarray(spec.lon, dtype=np.float64),
                         {"units": "degrees_east", "standard_name": "longitude", "axis": "X"}),
    }
    if levels:
        coords[conv.level] = (conv.level, np.asarray(levels, dtype=np.float64), {
            "units": "hPa", "standard_name": "air_pressure", "long_name": "pressure level", "positive": "down",
            "axis": "Z"})
    channels = [[c.name, c.variable, c.level, c.units] for c in spec.channels]
    attrs = {"Conventions": "CF-1.10", "title": "ensemble forecast", "source": "mesh3d forecast",
             RUN_ATTR: json.dumps(spec.run, sort_keys=True), "tile": list(spec.tile), CHANNELS_ATTR: json.dumps(channels),
             CONVENTION_ATTR: conv.name}
    xr.Dataset(coords=coords, attrs=attrs).to_zarr(building, mode="w", consolidated=False, zarr_format=3)
    root = zarr.open_group(building, mode="r+")
    lead_shape = (len(spec.init_times), spec.leads, spec.members)
    for name, where in fields.items():
        leveled = where[0][1] is not None
        shape = (*lead_shape, *((len(levels),) if leveled else ()), spec.lat.size, spec.lon.size)
        chunks = (1, 1, 1, *((1,) if leveled else ()), *spec.tile)
        arr = root.create_array(name, shape=shape, chunks=chunks, dtype=spec.dtype, fill_value=float("nan"),
                                dimension_names=conv.dims(leveled),
                                compressors="auto" if spec.compress else None)
        first = spec.channels[where[0][0]]
        names = cf_attrs(first.variable, first.units)
        if conv.per_channel and first.level is not None:   # z500: geopotential height at 500 hPa
            names["long_name"] += f" at {first.level:g} hPa"
        arr.attrs.update({"units": first.units, **names, "coordinates": "valid_time"})
    restart = root.create_group("restart")
    n, (c, h, w) = spec.samples, spec.shape[3:]
    restart.create_array("leads_done", shape=(n,), chunks=(1,), dtype="int32", fill_value=0)
    restart.create_array("state_lead", shape=(n, SLOTS), chunks=(1, SLOTS), dtype="int32", fill_value=-1)
    restart.create_array("state", shape=(n, SLOTS, c, h, w), chunks=(1, 1, c, *spec.tile), dtype=spec.state_dtype,
                         fill_value=float("nan"))
    _consolidate(building)
    try:
        os.replace(building, path)
    except OSError:
        if not os.path.isdir(path):
            raise
        shutil.rmtree(building, ignore_errors=True)   # another job created it first: the caller checks it is this run's


def _consolidate(path: str) -> None:
    import zarr  # noqa: PLC0415 (optional: the weather extra)

    with warnings.catch_warnings():
        # NOTE: zarr warns that consolidated metadata is not (yet) in the v3 spec; xarray's open_zarr reads it.
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(path)


def read_spec(path: str | os.PathLike) -> StoreSpec:
    """The spec of an existing store (its coordinates, chunks, dtypes and run record)."""
    import xarray as xr  # noqa: PLC0415 (optional: the weather extra)

    with xr.open_zarr(os.fspath(path), consolidated=False) as ds:
        conv = convention_of(ds.attrs)
        channels = store_channels(ds.attrs, os.fspath(path))
        fc = ds[store_fields(channels, conv)[0].variable]
        leads = ds[conv.lead].values
        return StoreSpec(tuple(ds[conv.init].values), leads[0], fc.sizes[conv.lead], fc.sizes[conv.member], channels,
                         np.asarray(ds[conv.latitude].values), np.asarray(ds[conv.longitude].values),
                         tuple(fc.encoding["chunks"][-2:]), str(fc.dtype), run=json.loads(ds.attrs.get(RUN_ATTR, "{}")),
                         convention=conv.name)


class ForecastStore:
    """An open store: this rank's blocks written into its fields, the restart record read and written.

    Usage: ``store = ForecastStore("fc.zarr"); store.write(i, k, m, block, rows, cols); store.writes``
    """

    def __init__(self, path: str | os.PathLike) -> None:
        import zarr  # noqa: PLC0415 (optional: the weather extra)

        self.path = os.fspath(path)
        self._root = zarr.open_group(self.path, mode="r+", use_consolidated=False)
        channels = store_channels(self._root.attrs, self.path)
        self.fields = FieldArrays(self._root, channels)
        self.leads = self._root[store_fields(channels, convention_of(self._root.attrs))[0].variable].shape[1]
        self.complete = "restart" not in self._root
        self._restart: Any = None if self.complete else self._root["restart"]
        #: Blocks written by this rank into the fields and into the restart state, and their bytes.
        self.writes = 0
        self.state_writes = 0
        self.bytes_written = 0

    def write(self, init: int, lead: int, member: int, blocks: np.ndarray, rows: tuple[int, int],
              cols: tuple[int, int]) -> None:
        """This rank's ``(n, C, h, w)`` blocks of members ``member .. member + n - 1`` at (init, lead index), in
        physical units (one call: zarr writes the chunks concurrently)."""
        if blocks.size == 0:
            return
        self.fields.write(init, lead, member, blocks.astype(self.fields.dtype, copy=False), rows, cols)
        self.writes += blocks.shape[0]
        self.bytes_written += blocks.size * self.fields.dtype.itemsize

    # ------------------------------------------------------------------ the restart record
    def leads_done(self, samples: list[int]) -> np.ndarray:
        if self._restart is None:
            return np.full(len(samples), self.leads, dtype=np.int64)
        return np.asarray(self._restart["leads_done"].get_orthogonal_selection((samples,)), dtype=np.int64)

    def state_leads(self, samples: list[int]) -> np.ndarray:
        """``(len(samples), SLOTS)``: the lead each restart slot holds (-1: none)."""
        if self._restart is None:
            return np.full((len(samples), SLOTS), -1, dtype=np.int64)
        return np.asarray(self._restart["state_lead"].get_orthogonal_selection((samples, slice(None))), dtype=np.int64)

    def read_state(self, sample: int, slot: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        return np.asarray(self._restart["state"][sample, slot, :, rows[0]:rows[1], cols[0]:cols[1]])

    def write_state(self, sample: int, slot: int, blocks: np.ndarray, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """This rank's ``(n, C, h, w)`` blocks of the states of samples ``sample .. sample + n - 1`` into ``slot``."""
        if blocks.size == 0:
            return
        self._restart["state"][sample:sample + blocks.shape[0], slot, :, rows[0]:rows[1], cols[0]:cols[1]] = blocks
        self.state_writes += blocks.shape[0]

    def record(self, samples: list[int], lead: int, slots: dict[int, int]) -> None:
        """(One rank per sample's group, after every rank wrote) ``lead`` leads of ``samples`` are in the store, and
        slot ``slots[s]`` of sample ``s`` holds its state at ``lead``."""
        kept = sorted(slots)
        if kept:
            self._restart["state_lead"].set_coordinate_selection((kept, [slots[s] for s in kept]), lead)
        self._restart["leads_done"].set_coordinate_selection((sorted(samples),), lead)

    def move_inputs(self, run: dict[str, Any]) -> None:
        """(One rank) record where the inputs lie now (``MOVABLE`` entries of ``run``), after a resume that found them
        elsewhere with the same content: scoring then reads the dataset where it is."""
        recorded = json.loads(self._root.attrs.get(RUN_ATTR, "{}"))
        recorded.update({key: run[key] for key in MOVABLE if key in run})
        self._root.attrs[RUN_ATTR] = json.dumps(recorded, sort_keys=True)
        _consolidate(self.path)

    def finish(self) -> None:
        """(One rank, after every rank finished) drop the restart record and consolidate the metadata."""
        if self._restart is not None:
            shutil.rmtree(os.path.join(self.path, "restart"), ignore_errors=True)   # NOTE: two last jobs may end at once
            self._restart, self.complete = None, True
        _consolidate(self.path)
