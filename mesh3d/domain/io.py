"""Reading only this domain rank's rows from storage: ``domain.read`` and the ``.npy`` reader ``NpyArray``.

A sample too big for one host is never read whole: each domain rank asks its array-like for the
rows it owns along ``dim`` (by ``split_sizes``, the same rule as ``domain.shard``) and wraps them
with ``domain.from_local``. Any array-like with numpy basic slicing works (``numpy.memmap``,
``zarr.Array``, ``h5py.Dataset``); a ``.npy`` path is opened as :class:`NpyArray`, which reads
the requested rows with ``os.pread`` and counts the bytes it read.

Usage::

    from mesh3d import domain
    xs = domain.read("fields.npy", dim=2, prefix=(7,))       # sample 7 of an (N, C, H, W) file, my rows of H
    xs = domain.read(np.load("f.npy", mmap_mode="r"), dim=1)  # my rows of dim 1 of the whole array
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mesh3d.domain.api import domain_comm, from_local
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["NpyArray", "open_array", "read", "read_rows", "slab_key"]


class NpyArray:
    """A ``.npy`` file read by basic slicing with ``os.pread``: only the bytes of the requested rows.

    Usage: ``a = NpyArray("f.npy"); block = a[3, :, 10:20]; a.bytes_read``

    C-order files of numeric dtypes only (Fortran order and object arrays are refused). Picklable
    (the file is reopened in each process), so it works inside ``DataLoader`` workers.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        if fortran:
            raise ValueError(f"{self.path}: Fortran-order .npy files are not supported (save with np.ascontiguousarray)")
        if dtype.hasobject:
            raise ValueError(f"{self.path}: object arrays need pickle, which mesh3d never loads")
        self.shape, self.dtype = tuple(shape), dtype
        self.bytes_read = 0
        self._fd: int | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def _ranges(self, key: Any) -> tuple[list[tuple[int, int]], list[int]]:
        """Per axis (start, stop) of ``key`` and the axes that stay in the result."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > self.ndim:
            raise IndexError(f"too many indices ({len(key)}) for a {self.ndim}-D array")
        ranges, kept = [], []
        for axis, size in enumerate(self.shape):
            k = key[axis] if axis < len(key) else slice(None)
            if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                i = int(k) + (size if k < 0 else 0)
                if not 0 <= i < size:
                    raise IndexError(f"index {int(k)} is out of bounds for axis {axis} of size {size}")
                ranges.append((i, i + 1))
            elif isinstance(k, slice) and k.step in (None, 1):
                start, stop, _ = k.indices(size)
                ranges.append((start, max(start, stop)))
                kept.append(axis)
            else:
                raise IndexError(f"NpyArray supports ints and unit-step slices only, got {k!r} for axis {axis}")
        return ranges, kept

    def __getitem__(self, key: Any) -> np.ndarray:
        ranges, kept = self._ranges(key)
        extents = [b - a for a, b in ranges]
        out = np.empty(extents, dtype=self.dtype)
        if out.size == 0:
            return out.reshape([extents[a] for a in kept])
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        item = self.dtype.itemsize
        strides = [int(np.prod(self.shape[a + 1:], dtype=np.int64)) * item for a in range(self.ndim)]
        # Axes after `inner` are whole and axis `inner` is one contiguous range: one pread per index of the rest.
        inner = self.ndim - 1
        while inner > 0 and ranges[inner] == (0, self.shape[inner]):
            inner -= 1
        run = extents[inner] * strides[inner]
        flat = out.reshape(-1).view(np.uint8)
        for n, outer in enumerate(np.ndindex(*extents[:inner])):
            start = self.offset + ranges[inner][0] * strides[inner]
            start += sum((ranges[a][0] + i) * strides[a] for a, i in enumerate(outer))
            view = memoryview(flat[n * run:(n + 1) * run])
            got = os.preadv(self._fd, [view], start)
            if got != run:
                raise OSError(f"{self.path}: short read ({got} of {run} bytes at offset {start}); is the file truncated?")
            self.bytes_read += got
        return out.reshape([extents[a] for a in kept])


def open_array(source: Any) -> Any:
    """A ``.npy`` path as :class:`NpyArray`; any array-like as it is.

    Usage: ``arr = open_array("fields.npy")  # or a numpy memmap, zarr or h5py array``
    """
    if isinstance(source, (str, os.PathLike)):
        if not os.fspath(source).endswith(".npy"):
            raise ValueError(f"{source}: only .npy paths are opened by name; open other formats yourself "
                             "(zarr.open, h5py.File(...)[name]) and pass the array")
        return NpyArray(source)
    if not hasattr(source, "shape") or not hasattr(source, "__getitem__"):
        raise TypeError(f"expected a .npy path or an array-like with .shape and numpy slicing, got {type(source).__name__}")
    return source


def slab_key(shape: Sequence[int], dim: int, sizes: Sequence[int], index: int,
             prefix: tuple[int, ...] = ()) -> tuple[Any, ...]:
    """The slicing key of domain rank ``index``'s rows along ``dim`` of ``array[prefix]``.

    Usage: ``array[slab_key(array.shape, dim=1, sizes=(3, 2), index=1, prefix=(4,))]``
    """
    start = sum(sizes[:index])
    return tuple(prefix) + (slice(None),) * dim + (slice(start, start + sizes[index]),)


def _check(shape: Sequence[int], dim: int, prefix: tuple[int, ...]) -> int:
    ndim = len(shape) - len(prefix)
    if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) for i in prefix) or ndim < 1:
        raise ValueError(f"prefix={prefix!r} must be ints indexing the leading axes of the {len(shape)}-D array")
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim!r} is out of range for the {ndim}-D array selected by prefix={prefix!r}")
    return dim % ndim


def read_rows(array: Any, dim: int, parts: int, index: int, sizes: Sequence[int] | None = None,
              prefix: tuple[int, ...] = ()) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Rank ``index`` of ``parts``'s rows of ``array[prefix]`` along ``dim``, as a plain tensor, and all sizes.

    Usage: ``local, sizes = read_rows(arr, dim=1, parts=4, index=2, prefix=(i,))``

    No communication (safe in ``DataLoader`` workers); only the rows of rank ``index`` are requested.
    """
    prefix = tuple(prefix)
    dim = _check(array.shape, dim, prefix)
    length = array.shape[len(prefix) + dim]
    sizes = split_sizes(length, parts, sizes)
    block = np.asarray(array[slab_key(array.shape, dim, sizes, index, prefix)])
    return torch.from_numpy(np.array(block, copy=True, order="C")), sizes


def read(array: Any, dim: int, sizes: Sequence[int] | None = None, *, prefix: tuple[int, ...] = ()) -> DomainTensor:
    """This domain rank's rows of ``array[prefix]`` along ``dim`` as a ``DomainTensor``; other rows are never read.

    Usage: ``xs = domain.read("fields.npy", dim=2, prefix=(i,))  # or a memmap / zarr / h5py array``

    ``sizes`` as for ``domain.shard`` (default: ``torch.chunk``'s split). No communication: every
    rank computes the same split from the array's shape.
    """
    comm = domain_comm()
    local, sizes = read_rows(open_array(array), dim, comm.size, comm.index, sizes, prefix)
    return from_local(local, dim=dim % local.ndim, sizes=sizes)
