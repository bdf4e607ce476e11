"""A zarr v3 store wrapper that counts the bytes it hands out (chunks and metadata): ``CountingStore``.

Imported only when a zarr store is opened through ``mesh3d.data`` (zarr is an optional extra).

Usage::

    store = CountingStore(zarr.storage.LocalStore("era5.zarr", read_only=True), ReadCounter())
    xarray.open_zarr(store, chunks=None); store.counter.bytes
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import zarr
from zarr.storage import LocalStore, WrapperStore

from mesh3d.data.counting import ReadCounter

__all__ = ["CountingStore", "open_counted_zarr"]


class CountingStore(WrapperStore):
    """Delegates to the wrapped store; every buffer returned by ``get``/``get_partial_values`` is counted."""

    def __init__(self, store: Any, counter: ReadCounter | None = None) -> None:
        super().__init__(store)
        self.counter = counter if counter is not None else ReadCounter()

    def _with_store(self, store: Any) -> CountingStore:
        return type(self)(store, self.counter)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None:
            self.counter.add(len(buf))
        return buf

    async def get_partial_values(self, prototype: Any, key_ranges: Iterable[tuple[str, Any]]) -> list[Any]:
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        for buf in bufs:
            if buf is not None:
                self.counter.add(len(buf))
        return bufs


def counting_store(path: str, counter: ReadCounter) -> CountingStore:
    """A read-only local zarr store at ``path`` whose reads go to ``counter``."""
    return CountingStore(LocalStore(path, read_only=True), counter)


def open_counted_zarr(path: str, name: str | None, counter: ReadCounter) -> Any:
    """The zarr array ``name`` (or the store's root array) at ``path``, read through a counting store."""
    return zarr.open_array(store=counting_store(path, counter), path=name or "", mode="r")
