"""Live memory of one simulated step: every meta storage an op allocates, plus named buffers.

A ``TorchDispatchMode`` sees each aten op's outputs; a storage not seen before and not aliasing an input is an
allocation, and a weakref finalizer on it records its release, so the count follows autograd's own lifetimes
(saved tensors freed as backward consumes them). Buffers that the step would hold but the simulation does not
allocate (FSDP's gathered parameters and reduce-scatter buffers) are added by name. The peak keeps a
breakdown by category. ``block_bytes`` maps a request to what the device's allocator counts for it (CUDA's
caching allocator rounds: ``mesh3d.planner.allocator``); every allocation, named buffer and workspace goes
through it.

Usage::

    with MemoryTracker() as mem:
        loss = model(x_on_meta).sum(); loss.backward()
    mem.peak, mem.peak_by_category          # bytes, {"activations": ..., "fsdp buffers": ..., ...}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from mesh3d.planner.meta_outputs import MetaOutputs, storages_of
from mesh3d._torch_private import TorchDispatchMode, storage_key

__all__ = ["ACTIVATIONS", "ADDED", "REMOVED", "SPIKE", "FSDP_BUFFERS", "GRADS", "HALO", "MemoryTracker", "Workspace"]

ACTIVATIONS, HALO, FSDP_BUFFERS, GRADS, WORKSPACE = "activations", "halo buffers", "fsdp buffers", "grads", "kernel workspace"

#: The kinds of ``MemoryTracker.events``.
ADDED, REMOVED, SPIKE = 0, 1, 2

#: A function giving the transient bytes a kernel needs beside its inputs and outputs (0: none).
Workspace = Callable[[object, tuple, dict, object], int]


class MemoryTracker(TorchDispatchMode):
    """Bytes alive during a step, their peak and what made it up (see the module docstring)."""

    def __init__(self, workspace: Workspace | None = None, outputs: MetaOutputs | None = None,
                 block_bytes: Callable[[int], int] | None = None) -> None:
        super().__init__()
        self._block = block_bytes or (lambda n: n)
        self._live: dict[int, tuple[str, int]] = {}  # storage key -> (category, bytes)
        self._named: dict[str, tuple[str, int]] = {}  # named buffers (FSDP's) -> (category, bytes)
        self._by_category: dict[str, int] = {}
        self._workspace = workspace
        self._outputs = outputs or MetaOutputs()  # shared by a plan's simulated ranks: their layers repeat
        self.current = 0
        self.peak = 0
        self.peak_by_category: dict[str, int] = {}
        #: With ``record()``: every change in order, as (ADDED, REMOVED or SPIKE, category, bytes); the planner
        #: splices these to extrapolate repeated layers (``mesh3d.planner.repeat``).
        self.events: list[tuple[int, str, int]] | None = None

    # ------------------------------------------------------------------ bookkeeping
    def record(self) -> None:
        """Keep every change in ``events`` from now on (see its comment)."""
        self.events = []

    def _add(self, category: str, nbytes: int) -> None:
        self.current += nbytes
        self._by_category[category] = self._by_category.get(category, 0) + nbytes
        if self.events is not None:
            self.events.append((ADDED, category, nbytes))
        self._note_peak()

    def _sub(self, category: str, nbytes: int) -> None:
        self.current -= nbytes
        self._by_category[category] -= nbytes
        if self.events is not None:
            self.events.append((REMOVED, category, nbytes))

    def _note_peak(self, extra: int = 0, extra_category: str = WORKSPACE) -> None:
        if self.current + extra > self.peak:
            self.peak = self.current + extra
            self.peak_by_category = {k: v for k, v in self._by_category.items() if v}
            if extra:
                self.peak_by_category[extra_category] = self.peak_by_category.get(extra_category, 0) + extra

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._sub(*entry)

    def track(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage (if new) under ``category``, or move it there if already counted."""
        storage = t.untyped_storage()
        key = storage_key(storage)
        old = self._live.get(key)
        if old is not None:
            self._sub(*old)
            self._live[key] = (category, old[1])
            self._add(category, old[1])
            return
        nbytes = self._block(storage.nbytes())
        self._live[key] = (category, nbytes)
        self._add(category, nbytes)
        weakref.finalize(storage, self._release, key)

    def alloc(self, name: str, category: str, nbytes: int, pieces: Sequence[int] | None = None) -> None:
        """A buffer the simulation does not create itself (FSDP's), alive until ``free(name)``; ``pieces``: the
        sizes of the separate allocations it is made of (``nbytes`` is one allocation otherwise)."""
        if name in self._named:
            return
        nbytes = sum(self._block(n) for n in pieces) if pieces is not None else self._block(nbytes)
        self._named[name] = (category, nbytes)
        self._add(category, nbytes)

    def free(self, name: str) -> None:
        entry = self._named.pop(name, None)
        if entry is not None:
            self._sub(*entry)

    def spike(self, category: str, nbytes: int) -> None:
        """A buffer alive only for a moment (allocated and released at once): it can only raise the peak."""
        self._spike(self._block(nbytes), category)

    def _spike(self, extra: int, category: str = WORKSPACE) -> None:
        if self.events is not None:
            self.events.append((SPIKE, category, extra))
        self._note_peak(extra, category)

    # ------------------------------------------------------------------ the dispatch mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "_wraps", False) for t in types):
            # NOTE: a wrapper domain tensor has no storage of its own: its floor runs the op on the shards, which come
            # back here as plain tensors to be counted (cached outputs would hand autograd a plain tensor for it)
            return NotImplemented
        kwargs = kwargs or {}
        inputs = {storage_key(s) for s in storages_of((args, kwargs))}
        out = self._outputs.call(func, args, kwargs)
        for storage in storages_of(out):
            if storage.device.type != "meta":
                # NOTE: the step runs on meta tensors; a real tensor is the host's bookkeeping (a plan's cached index
                # of rows, built on first use and kept): counted, it would depend on which step built it first
                continue
            key = storage_key(storage)
            if key in inputs or key in self._live:
                continue  # a view, or an in-place result
            nbytes = self._block(storage.nbytes())
            self._live[key] = (ACTIVATIONS, nbytes)
            self._add(ACTIVATIONS, nbytes)
            weakref.finalize(storage, self._release, key)
        if self._workspace is not None:
            extra = self._workspace(func, args, kwargs, out)
            if extra:
                self._spike(self._block(extra))
        return out
