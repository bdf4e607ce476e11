"""Counting what storage hands out: ``ReadCounter`` and ``CountingFile`` (a file object h5py/h5netcdf read through).

Usage::

    counter = ReadCounter()
    f = CountingFile("era5.nc", counter); h5py.File(f, "r")["t2m"][0, :10]; counter.bytes
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

__all__ = ["CountingFile", "ReadCounter"]


class ReadCounter:
    """Bytes and reads handed out by one store or file (thread-safe: zarr reads on its own event-loop thread).

    Usage: ``counter.bytes, counter.reads``
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.reads = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "reads": self.reads}  # a lock does not pickle (DataLoader workers)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.reads += 1


class CountingFile(io.RawIOBase):
    """A read-only binary file whose reads are counted: h5py and h5netcdf read through it (``driver="fileobj"``).

    Usage: ``h5py.File(CountingFile("x.nc"), "r")``; ``xarray.open_dataset(CountingFile(p), engine="h5netcdf")``
    """

    def __init__(self, path: str | os.PathLike, counter: ReadCounter | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.counter = counter if counter is not None else ReadCounter()
        self._file = open(self.path, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: Any) -> int:
        got = self._file.readinto(buffer)
        self.counter.add(got or 0)
        return got

    def close(self) -> None:
        self._file.close()
        super().close()
