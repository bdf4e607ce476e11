"""``ForecastWriter``: each rank writes its own block of every forecast step into one zarr store or ``.npy`` file.

Nothing is gathered to one rank. The store holds ``forecast`` of shape ``(samples, steps, C, H, W)``. Global
rank 0 creates it (its size, and for zarr the chunk grid, from the layout of ``like``); then every rank
opens it and writes the rows of each step it owns: a domain rank its (lat, lon) block, one model rank of each
group (the others hold the same values). zarr chunks are aligned to the blocks (a chunk's lat/lon length
divides every block offset), so no chunk is written by two ranks; a ``.npy`` is written with ``os.pwrite``
at each row's offset. ``close()`` waits for every rank (a barrier on the world group, bounded by its timeout).

Usage::

    writer = ForecastWriter("forecast.zarr", num_samples=len(ds), steps=8, like=x0, channels=ds.channel_names,
                            lat=ds.lat, lon=ds.lon)        # a collective: every rank of the job calls it
    forecast(model, x0, 8, writer, sample_ids=batch["index"])
    writer.close()
    xarray.open_zarr("forecast.zarr")["forecast"]           # (sample, step, channel, lat, lon)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mesh3d.manager import DistributedManager

__all__ = ["ForecastWriter"]

DIMS = ("sample", "step", "channel", "lat", "lon")


def _layout(like: torch.Tensor) -> tuple[tuple[int, ...], tuple[tuple[int, ...] | None, ...], tuple[int, ...], bool]:
    """(global (C, H, W), every rank's sizes along lat and lon or None, this rank's (lat, lon) offset, replicated)."""
    shape = tuple(like.shape)
    if len(shape) != 4:
        raise ValueError(f"ForecastWriter: like= must be a (B, C, H, W) state, got shape {shape}")
    spec = getattr(like, "spec", None)
    if spec is None:
        return shape[1:], (None, None), (0, 0), True
    if hasattr(spec, "dims"):
        if tuple(spec.dims) not in ((2, 3),):
            raise ValueError(f"ForecastWriter: blocks must split (lat, lon) = dims (2, 3), got dims {spec.dims}")
        return shape[1:], tuple(spec.sizes), tuple(spec.offsets), False
    if spec.dim is None:
        return shape[1:], (None, None), (0, 0), True
    if spec.dim not in (2, 3):
        raise ValueError(f"ForecastWriter: slabs must split lat (dim 2) or lon (dim 3), got dim {spec.dim}")
    sizes: list[tuple[int, ...] | None] = [None, None]
    offsets = [0, 0]
    sizes[spec.dim - 2], offsets[spec.dim - 2] = tuple(spec.sizes), spec.offset
    return shape[1:], tuple(sizes), tuple(offsets), False


def _chunk(length: int, sizes: tuple[int, ...] | None) -> int:
    """The largest chunk length whose multiples include every block offset (so blocks never share a chunk)."""
    if sizes is None:
        return length
    offsets = np.cumsum((0, *sizes))[1:-1]
    g = 0
    for o in offsets:
        g = math.gcd(g, int(o))
    return g or length


class ForecastWriter:
    """Writes ``(samples, steps, C, H, W)`` forecasts block by block into ``path`` (``.zarr`` directory or ``.npy``).

    Usage: ``w = ForecastWriter("fc.zarr", 16, 8, like=x0); w.write(ids, step, y); w.close()``
    """

    def __init__(self, path: str | os.PathLike, num_samples: int, steps: int, like: torch.Tensor, *,
                 channels: Sequence[str] | None = None, lat: Any = None, lon: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        self.path = os.fspath(path)
        self.format = "npy" if self.path.endswith(".npy") else "zarr"
        (c, h, w), sizes, self.offset, replicated = _layout(like)
        self.shape = (int(num_samples), int(steps), c, h, w)
        self.dtype = np.dtype(str(dtype or like.dtype).removeprefix("torch."))
        if num_samples < 1 or steps < 1 or (channels is not None and len(channels) != c):
            raise ValueError(f"ForecastWriter: num_samples={num_samples}, steps={steps} must be >= 1 and channels "
                             f"(if given) {c} names, got {channels!r}")
        dm = DistributedManager() if DistributedManager.is_initialized() else None
        self.group = dm.world_mesh.get_group() if dm is not None else None
        coords = dm.coordinates if dm is not None else {"domain": 0, "model": 0}
        #: NOTE: model ranks hold the same values, and a replicated state is whole on every domain rank: one writes.
        self.writes = coords["model"] == 0 and (not replicated or coords["domain"] == 0)
        first = dm is None or dm.rank == 0
        self.chunks = (1, 1, c, _chunk(h, sizes[0]), _chunk(w, sizes[1]))
        if first:
            self._create(channels, lat, lon)
        self._barrier()
        self._array: Any = self._open() if self.writes else None

    def _barrier(self) -> None:
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)

    def _create(self, channels: Sequence[str] | None, lat: Any, lon: Any) -> None:
        if self.format == "npy":
            np.lib.format.open_memmap(self.path, mode="w+", dtype=self.dtype, shape=self.shape).flush()
            return
        import zarr  # noqa: PLC0415 (optional: zarr, the weather extra)

        root = zarr.open_group(self.path, mode="w")
        arr = root.create_array("forecast", shape=self.shape, chunks=self.chunks, dtype=self.dtype,
                                fill_value=float("nan"), dimension_names=DIMS)
        names = list(channels) if channels is not None else [f"c{i}" for i in range(self.shape[2])]
        arr.attrs["channels"] = names
        coord = root.create_array("channel", shape=(len(names),), dtype=str, dimension_names=("channel",))
        coord[:] = np.array(names, dtype=np.dtypes.StringDType())  # a coordinate: xarray selects by name
        for name, values, units in (("lat", lat, "degrees_north"), ("lon", lon, "degrees_east")):
            if values is not None:
                coord = root.create_array(name, shape=(len(values),), dtype="f8", dimension_names=(name,))
                coord[:] = np.asarray(values, dtype=np.float64)
                coord.attrs["units"] = units

    def _open(self) -> Any:
        if self.format == "npy":
            with open(self.path, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                (np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0)(f)
                self._header = f.tell()
            return os.open(self.path, os.O_WRONLY)
        import zarr  # noqa: PLC0415 (optional: zarr, the weather extra)

        return zarr.open_array(self.path, path="forecast", mode="r+")

    def write(self, sample_ids: Sequence[int] | torch.Tensor, step: int, state: torch.Tensor) -> None:
        """Write this rank's block of ``state`` (B, C, H, W) as step ``step`` of the samples ``sample_ids``."""
        ids = [int(i) for i in (sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids)]
        if len(ids) != state.shape[0] or not 0 <= step < self.shape[1] or any(not 0 <= i < self.shape[0] for i in ids):
            raise ValueError(f"ForecastWriter.write: {len(ids)} sample ids {ids} for a batch of {state.shape[0]}, step "
                             f"{step}: ids must lie in 0..{self.shape[0] - 1} and step in 0..{self.shape[1] - 1}")
        if not self.writes:
            return
        local = state.to_local() if hasattr(state, "to_local") else state
        block = local.detach().cpu().numpy().astype(self.dtype, copy=False)
        h0, w0 = self.offset
        hb, wb = block.shape[-2:]
        for j, sample in enumerate(ids):
            if block[j].size == 0:
                continue
            if self.format == "zarr":
                self._array[sample, step, :, h0:h0 + hb, w0:w0 + wb] = block[j]
            else:
                self._pwrite(sample, step, np.ascontiguousarray(block[j]), h0, w0)

    def _pwrite(self, sample: int, step: int, block: np.ndarray, h0: int, w0: int) -> None:
        _, _, c, h, w = self.shape
        item = self.dtype.itemsize
        for ch in range(c):
            for r in range(block.shape[1]):
                at = ((((sample * self.shape[1] + step) * c + ch) * h + h0 + r) * w + w0) * item
                data = block[ch, r].tobytes()
                if os.pwrite(self._array, data, self._header + at) != len(data):
                    raise OSError(f"{self.path}: short write at offset {self._header + at}")

    def close(self) -> None:
        """Wait until every rank has written (a barrier on the world group)."""
        if self.format == "npy" and self._array is not None:
            os.close(self._array)
        self._array = None
        self._barrier()
