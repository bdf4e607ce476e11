"""``WeatherDataset``: samples of an ``xarray.Dataset`` on a lat x lon grid, each domain rank reading only its block.

A weather dataset holds many variables (some on pressure levels) indexed by time. Item ``i`` is the state at
input time ``t_i`` as channels ``(C, lat, lon)`` and the states ``steps`` lead times later (the targets of a
rollout), normalized per channel, and only this domain rank's (lat, lon) block of each: on a 2-D domain grid
``(P, Q)`` latitude is split over P and longitude over Q; on a 1-D domain, latitude (slabs). Where the store is
chunked along lat/lon, the split follows the chunks when every rank still gets some (so no chunk is read by two
ranks). Storage reads are counted (``bytes_read``) when the dataset opened the store itself (a path).

Usage::

    ds = WeatherDataset("era5.zarr", {"z": [500], "t": [850], "t2m": None}, lead=1, steps=4, stats="compute")
    loader = MeshDataLoader(ds, MeshSampler(len(ds), global_batch_size=8, seed=0))
    for batch in loader:
        batch = ds.to_domain(batch)        # batch["x"]: DomainTensor (B, C, H, W); batch["y"]: a list, one per step
    ds.bytes_read, ds.block                # what this rank read; its (lat, lon) rows

xarray (and zarr / h5netcdf for the store) is the ``weather`` extra; the ``.npy`` path never needs it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from mesh3d.data.counting import CountingFile, ReadCounter
from mesh3d.data.stored import ZARR, store_kind
from mesh3d.data.weather_channels import Channel, ChannelStats, select_channels
from mesh3d.domain import aligned_sizes, from_local, split_sizes
from mesh3d.manager import DistributedManager

__all__ = ["WeatherDataset", "open_weather"]


def open_weather(path: str | os.PathLike, counter: ReadCounter | None = None) -> Any:
    """An ``xarray.Dataset`` over a zarr v3 store or a NetCDF4/HDF5 file, read lazily, its reads counted in ``counter``.

    Usage: ``ds = open_weather("era5.zarr", counter); ds["t2m"].isel(time=0).values; counter.bytes``
    """
    import xarray  # noqa: PLC0415 (optional: the weather extra)

    counter = counter if counter is not None else ReadCounter()
    if store_kind(path) == ZARR:
        from mesh3d.data.zarr_counting import counting_store  # noqa: PLC0415 (optional: zarr)

        return xarray.open_dataset(counting_store(os.fspath(path), counter), engine="zarr", chunks=None, cache=False,
                                   consolidated=False)
    return xarray.open_dataset(CountingFile(path, counter), engine="h5netcdf", chunks=None, cache=False)


#: The names each dim goes by in the field's stores (ERA5 from the CDS or ARCO, WeatherBench 2, CMIP), first match wins.
DIM_NAMES = {"lat": ("lat", "latitude"), "lon": ("lon", "longitude"), "time": ("time", "valid_time"),
             "level": ("level", "pressure_level", "isobaricInhPa", "plev")}


def dim_name(ds: Any, role: str) -> str:
    """The name ``ds`` gives the ``role`` dim ("lat", "lon", "time", "level"): the first of ``DIM_NAMES[role]`` it has
    (the first of them when it has none, for the error that names what is missing)."""
    names = DIM_NAMES[role]
    return next((n for n in names if n in ds.dims), names[0])


def _lead_steps(ds: Any, lead: Any, time: str) -> int:
    """``lead`` in index steps: an int, or a timedelta divided by the (uniform) spacing of the time coordinate."""
    if isinstance(lead, (int, np.integer)) and not isinstance(lead, (bool, np.timedelta64)):
        if lead < 1:
            raise ValueError(f"WeatherDataset: lead={lead} must be >= 1 time step")
        return int(lead)
    times = np.asarray(ds[time].values)
    steps = np.diff(times)
    if len(steps) == 0 or not (steps == steps[0]).all():
        raise ValueError(f"WeatherDataset: lead={_duration(lead)} is a duration, which needs a uniformly spaced {time!r} "
                         "coordinate; pass lead as a number of time steps instead")
    ratio = np.timedelta64(lead) / steps[0] if np.issubdtype(steps.dtype, np.timedelta64) else lead / steps[0]
    if ratio < 1 or float(ratio) != int(ratio):
        raise ValueError(f"WeatherDataset: lead={_duration(lead)} is not a positive multiple of the time step "
                         f"{_duration(steps[0])}")
    return int(ratio)


def _duration(value: Any) -> str:
    """A time step in hours (``6 h``) rather than ``np.timedelta64(21600000000000,'ns')``."""
    if isinstance(value, np.timedelta64):
        return f"{np.timedelta64(value, 'ns').astype(np.int64) / 3.6e12:g} h"
    return repr(value)


def _chunk_of(ds: Any, names: Sequence[str], dim: str) -> int | None:
    """The store's chunk length along ``dim`` (of the first variable that declares one)."""
    for name in names:
        enc = ds[name].encoding
        chunks = enc.get("preferred_chunks") or {}
        if dim in chunks:
            return int(chunks[dim])
    return None


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ints as ``[start, stop)`` runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class WeatherDataset(Dataset):
    """Per sample, this domain rank's (lat, lon) block of the selected channels at ``t`` and at ``t + k * lead``.

    Usage: ``ds = WeatherDataset("era5.zarr", {"z": [500], "t2m": None}, steps=2); ds[0]["x"], ds[0]["y"]``

    Args:
        source: a zarr store directory or a ``.nc``/``.h5`` path (opened here, reads counted), or an
            ``xarray.Dataset`` (used as is; ``bytes_read`` then stays 0, ``bytes_requested`` still counts).
        variables: names (every level), or ``{name: [levels] or None}``, in channel order.
        lead: the lead time, in time steps (int) or as a duration of the time coordinate.
        steps: targets per sample (``y`` holds ``steps`` states, for rollout training).
        stats: ``None`` (raw values), a :class:`ChannelStats` (or its dict), or ``"compute"``: per-channel mean and
            std over the input times, from each rank's block, summed over the domain group (a collective: every
            domain rank builds the dataset).
        times: the input time indices to use (default: every time with ``steps`` targets after it).
        sizes: per grid dim, every rank's rows (lat, then lon); default: chunk-aligned where it can, else
            ``torch.chunk``'s split.
        domain: ``(grid, coords)``; default the manager's domain grid and this rank's place on it.
    """

    def __init__(self, source: Any, variables: Sequence[str] | Mapping[str, Sequence[Any] | None], *, lead: Any = 1,
                 steps: int = 1, stats: ChannelStats | Mapping[str, Sequence[float]] | str | None = None,
                 times: Sequence[int] | None = None, sizes: Sequence[Sequence[int] | None] | None = None,
                 lat: str | None = None, lon: str | None = None, time: str | None = None, level: str | None = None,
                 dtype: torch.dtype = torch.float32, domain: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        self.counter = ReadCounter()
        self.path = None if hasattr(source, "data_vars") else os.fspath(source)
        self._ds = source if self.path is None else open_weather(self.path, self.counter)
        self._pid = os.getpid()
        lat, lon, time, level = (given or dim_name(self._ds, role) for role, given in
                                 (("lat", lat), ("lon", lon), ("time", time), ("level", level)))
        self.dim_names = {"lat": lat, "lon": lon, "time": time, "level": level}
        self.channels: tuple[Channel, ...] = select_channels(self._ds, variables, level=level, dims=(time, lat, lon))
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"WeatherDataset: steps={steps!r} must be an int >= 1 (targets per sample)")
        self.lead, self.steps, self.dtype = _lead_steps(self._ds, lead, time), steps, dtype
        n_times = self._ds.sizes[time]
        last = n_times - self.lead * steps
        self.times = tuple(range(last)) if times is None else tuple(int(t) for t in times)
        bad = [t for t in self.times if not 0 <= t < last]
        if not self.times or bad:
            raise ValueError(f"WeatherDataset: input times must lie in 0..{last - 1} ({n_times} times, lead {self.lead}, "
                             f"steps {steps}); got {bad or 'none'}")
        self.lat = np.asarray(self._ds[lat].values)
        self.lon = np.asarray(self._ds[lon].values)
        if domain is None:
            if DistributedManager.is_initialized():
                dm = DistributedManager()
                grid = tuple(dm.domain_grid)
                domain = (grid, tuple(int(c) for c in np.unravel_index(dm.axis_rank("domain"), grid)))  # row-major
            else:
                domain = ((1,), (0,))
        self.grid, self.coords = tuple(domain[0]), tuple(domain[1])
        if len(self.grid) not in (1, 2) or len(self.coords) != len(self.grid):
            raise ValueError(f"WeatherDataset: the domain grid {self.grid} must have 1 dim (lat slabs) or 2 (lat x lon "
                             "blocks)")
        self.split_dims = (lat, lon)[: len(self.grid)]
        names = [c.variable for c in self.channels]
        given = list(sizes) if sizes is not None else [None] * len(self.grid)
        if len(given) != len(self.grid):
            raise ValueError(f"WeatherDataset: sizes has {len(given)} entries for the {len(self.grid)}-dim domain grid")
        self.sizes = tuple(self._layout(d, g, s, names) for d, g, s in zip(self.split_dims, self.grid, given))
        self.block = {d: (sum(s[:c]), sum(s[:c + 1])) for d, s, c in zip(self.split_dims, self.sizes, self.coords)}
        for d, n in ((lat, len(self.lat)), (lon, len(self.lon))):
            self.block.setdefault(d, (0, n))
        self.bytes_requested = 0
        if stats == "compute":
            stats = self.compute_stats()
        elif isinstance(stats, Mapping):
            stats = ChannelStats.from_dict(stats)
        elif stats is not None and not isinstance(stats, ChannelStats):
            raise ValueError(f"WeatherDataset: stats={stats!r} must be None, 'compute', a ChannelStats or its dict")
        self.stats: ChannelStats | None = stats

    def _layout(self, dim: str, parts: int, given: Sequence[int] | None, names: Sequence[str]) -> tuple[int, ...]:
        length = self._ds.sizes[dim]
        if given is not None:
            return split_sizes(length, parts, given)
        chunk = _chunk_of(self._ds, names, dim)
        if chunk and chunk < length and length // chunk >= parts:
            return aligned_sizes(length, parts, chunk)  # NOTE: block edges on chunk edges: no chunk read twice
        return split_sizes(length, parts)

    # ------------------------------------------------------------------ reading
    @property
    def dataset(self) -> Any:
        """The ``xarray.Dataset`` (reopened in a new process, e.g. a ``DataLoader`` worker)."""
        if self._ds is None or (self.path is not None and self._pid != os.getpid()):
            self.counter, self._pid = ReadCounter(), os.getpid()
            self._ds = open_weather(self.path, self.counter)
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None if self.path is not None else self._ds}

    def __len__(self) -> int:
        return len(self.times)

    def read_block(self, time_indices: Sequence[int], dtype: Any = np.float64) -> np.ndarray:
        """This rank's block of every channel at ``time_indices``: ``(len(time_indices), C, h, w)``, raw, in ``dtype``.

        Each variable's values go straight into the result (no second copy of the block)."""
        ds, names = self.dataset, self.dim_names
        window = {names["lat"]: slice(*self.block[names["lat"]]), names["lon"]: slice(*self.block[names["lon"]])}
        (a, b), (c, d) = self.block[names["lat"]], self.block[names["lon"]]
        out = np.empty((len(time_indices), len(self.channels), b - a, d - c), dtype=dtype)
        first = 0
        for var, run in itertools.groupby(self.channels, key=lambda c: c.variable):  # consecutive channels of a variable
            levels = [c.level_index for c in run]
            select: dict[str, Any] = {names["time"]: list(time_indices), **window}
            if levels[0] is None:
                out[:, first] = self._read(ds[var], select, [names["time"], names["lat"], names["lon"]])
                first += 1
                continue
            # NOTE: one list index per read (the times), each run of consecutive levels a slice: HDF5 backends read a
            # second list index as the whole range it spans.
            for start, stop in _runs(sorted(set(levels))):
                block = self._read(ds[var], {**select, names["level"]: slice(start, stop)},
                                   [names["time"], names["level"], names["lat"], names["lon"]])
                for j, lv in enumerate(levels):
                    if start <= lv < stop:
                        out[:, first + j] = block[:, lv - start]
            first += len(levels)
        return out

    def _read(self, array: Any, select: dict[str, Any], order: list[str]) -> np.ndarray:
        values = np.asarray(array.isel(select).transpose(*order).values)  # the store's dtype: cast into the result
        self.bytes_requested += values.size * array.dtype.itemsize
        return values

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a dataset of {len(self)}")
        t = self.times[i]
        fields = self.read_block([t + k * self.lead for k in range(self.steps + 1)])
        if self.stats is not None:
            mean, std = self.stats.arrays(len(self.channels))
            fields = (fields - mean) / std
        fields_t = torch.from_numpy(np.ascontiguousarray(fields)).to(self.dtype)
        return {"index": i, "time": t, "x": fields_t[0], "y": list(fields_t[1:])}

    def compute_stats(self) -> ChannelStats:
        """Per-channel mean and std over the input times and the whole grid (this rank's block, summed over the domain)."""
        c = len(self.channels)
        moments = torch.zeros(2 * c + 1, dtype=torch.float64)
        for t in self.times:
            block = torch.from_numpy(self.read_block([t])[0])
            moments[:c] += block.sum(dim=(1, 2))
            moments[c:2 * c] += (block ** 2).sum(dim=(1, 2))
            moments[-1] += block[0].numel()
        if DistributedManager.is_initialized() and DistributedManager().axis_size("domain") > 1:
            dist.all_reduce(moments, group=DistributedManager().group("domain"))
        return ChannelStats.from_moments(moments[:c].numpy(), moments[c:2 * c].numpy(), float(moments[-1]))

    # ------------------------------------------------------------------ onto the mesh
    def to_domain(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A collated batch with ``x`` a ``DomainTensor`` (B, C, H, W) and ``y`` a list of ``steps`` of them (in one
        process, the collated batch is used as it is: ``y`` is already a list of ``(B, C, H, W)`` tensors)."""
        out = dict(batch)
        out["x"] = self._wrap(batch["x"])
        out["y"] = [self._wrap(y) for y in batch["y"]]
        return out

    def _wrap(self, local: torch.Tensor) -> Any:
        if len(self.grid) == 1:
            return from_local(local, dim=2, sizes=self.sizes[0])
        return from_local(local, dims=(2, 3), sizes=self.sizes)

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from the store (0 for a dataset passed in open: see ``bytes_requested``)."""
        return self.counter.bytes

    @property
    def channel_names(self) -> list[str]:
        return [c.name for c in self.channels]
