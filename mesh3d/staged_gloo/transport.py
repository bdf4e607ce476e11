"""The process's staged gloo transport: registered with torch as the backend ``gloo_staged``, it makes the groups.

Usage::

    STAGED.register()                                    # once per process; the manager does it when it is chosen
    group = dist.new_group(ranks, backend=STAGED_BACKEND)
    STAGED.stats.staged_ops, STAGED.stats.reused         # what it moved, how often a host buffer was reused
    with STAGED.using(copies):                           # tests: groups made inside stage through ``copies``
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from mesh3d.staged_gloo.buffers import HostBuffers, StagingStats
from mesh3d.staged_gloo.copies import CudaCopies, DeviceCopies
from mesh3d.staged_gloo.group import STAGED_BACKEND, StagedGlooGroup

__all__ = ["STAGED", "StagedGlooTransport"]


class StagedGlooTransport:
    """The device copies and host buffers new staged groups use, and the one registration with torch."""

    def __init__(self) -> None:
        self.stats = StagingStats()
        self.buffers = HostBuffers(CudaCopies(), self.stats)
        self._registered = False

    def register(self) -> str:
        """Register the backend with torch (once per process); returns its name, ``"gloo_staged"``.

        NOTE: lazily, not at import: a registered plugin changes how torch picks a group's default backend for
        multi-device backend strings ("cpu:gloo,cuda:gloo"), so only a process that uses it registers it.
        """
        if not self._registered:
            dist.Backend.register_backend(STAGED_BACKEND, self._make_group, extended_api=True, devices=["cpu", "cuda"])
            self._registered = True
        return STAGED_BACKEND

    def _make_group(self, options: Any, _backend_options: Any) -> StagedGlooGroup:
        """torch's creator call (``extended_api``): one gloo backend on the group's own store prefix and timeout."""
        gloo = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)
        return StagedGlooGroup(gloo, options.group_rank, options.group_size, self.buffers)

    @contextmanager
    def using(self, copies: DeviceCopies) -> Iterator[HostBuffers]:
        """Groups made inside stage through ``copies`` (their own buffers, this transport's stats); for tests that run
        the staging logic on CPU ranks with copies that stand in for a device."""
        before = self.buffers
        self.buffers = HostBuffers(copies, self.stats)
        try:
            yield self.buffers
        finally:
            self.buffers = before


#: The process's transport.
STAGED = StagedGlooTransport()
