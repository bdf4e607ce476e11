"""Arrays in zarr v3 stores and HDF5/NetCDF4 files, read by slices, with every byte taken from storage counted.

``domain.read`` and ``SlabDataset`` take any array-like with numpy basic slicing; a zarr or h5py array
works as it is. Opened here instead, the array also reports ``bytes_read``: the bytes its store or file
handed out (zarr: the chunks fetched; HDF5: every read of the file, metadata included), so a job can
check that a domain rank read its own rows and nothing of the others'. Like ``NpyArray`` it opens its
store lazily in each process, so it can be pickled into ``DataLoader`` workers (each worker counts its own).

Usage::

    from mesh3d.data import StoredArray, SlabDataset
    x = StoredArray("fields.zarr")                    # a zarr v3 array (or StoredArray("era5.zarr", "t2m"))
    y = StoredArray("fields.nc", "y")                 # a NetCDF4 (HDF5) variable, or an .h5 dataset
    ds = SlabDataset({"x": x, "y": y}, dim=2)
    ds[0]; ds.bytes_read                              # this rank's rows of sample 0, and what it cost

xarray, zarr, h5py and h5netcdf are the ``weather`` extra; nothing here imports them until an array opens.
"""

from __future__ import annotations

import os
from typing import Any

from mesh3d.data.counting import CountingFile, ReadCounter

__all__ = ["StoredArray", "store_kind"]

ZARR, HDF5 = "zarr", "hdf5"
_HDF5_SUFFIXES = (".nc", ".nc4", ".h5", ".hdf5", ".he5")


def store_kind(path: str | os.PathLike) -> str:
    """``"zarr"`` for a directory (or a ``.zarr`` path), ``"hdf5"`` for ``.nc``/``.h5`` files; anything else raises."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.rstrip("/").endswith(".zarr"):
        return ZARR
    if path.endswith(_HDF5_SUFFIXES):
        return HDF5
    raise ValueError(f"{path}: not a zarr store (a directory) or an HDF5/NetCDF4 file ({', '.join(_HDF5_SUFFIXES)}); "
                     "open other formats yourself and pass the array")


class StoredArray:
    """One array of a zarr v3 store or an HDF5/NetCDF4 file, sliced like numpy, its storage reads counted.

    Usage: ``a = StoredArray("era5.zarr", "t2m"); a[3, 10:20]; a.bytes_read``

    ``name`` is the array's path inside the store or file (``None``: the store is one array). The store
    opens on first use in each process (pickling drops the handle).
    """

    def __init__(self, path: str | os.PathLike, name: str | None = None) -> None:
        self.path, self.name = os.fspath(path), name
        self.kind = store_kind(self.path)
        if self.kind == HDF5 and not name:
            raise ValueError(f"{self.path}: name the dataset/variable to read inside the HDF5/NetCDF4 file")
        self.counter = ReadCounter()
        self._array: Any = None
        self._pid: int | None = None
        self.shape, self.dtype = tuple(self._open().shape), self._open().dtype

    def _open(self) -> Any:
        if self._array is None or self._pid != os.getpid():
            self.counter = ReadCounter() if self._pid not in (None, os.getpid()) else self.counter
            if self.kind == ZARR:
                from mesh3d.data.zarr_counting import open_counted_zarr  # noqa: PLC0415 (optional: zarr)

                self._array = open_counted_zarr(self.path, self.name, self.counter)
            else:
                import h5py  # noqa: PLC0415 (optional: h5py, the weather extra)

                self._array = h5py.File(CountingFile(self.path, self.counter), "r")[self.name]
            self._pid = os.getpid()
        return self._array

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def chunks(self) -> tuple[int, ...] | None:
        """The storage's chunk shape (None for a contiguous HDF5 dataset)."""
        return getattr(self._open(), "chunks", None)

    def __getitem__(self, key: Any) -> Any:
        return self._open()[key]

    @property
    def bytes_read(self) -> int:
        """Bytes this process's handle read from storage so far."""
        return self.counter.bytes

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None, "_pid": None, "counter": ReadCounter()}
