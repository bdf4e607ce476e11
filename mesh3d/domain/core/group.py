"""The domain group as plain data (``DomainComm``): which manager axis, its members' global ranks, my index.

Usage: ``comm = DomainComm("domain", (0, 2), 1, epoch); comm.size, comm.group``
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.manager import DistributedManager

__all__ = ["LIVE_COMMS", "DomainComm", "LiveComms", "domain_groups"]


class LiveComms:
    """How many ``DomainComm`` objects this process holds, and what to do when the first is made and the last goes.

    Every domain tensor's spec holds a comm, so while none is alive no domain tensor is either: ``mesh3d.domain``
    installs its process hooks (``process_hooks.py``) on the first and removes them after the last.

    Usage: ``LIVE_COMMS.watch(on_first=hooks.install, on_none=hooks.remove); LIVE_COMMS.count``
    """

    def __init__(self) -> None:
        self.count = 0
        self._on_first: Callable[[], Any] | None = None
        self._on_none: Callable[[], Any] | None = None
        # NOTE: re-entrant: a comm's __del__ may run from the garbage collector while this thread holds the lock
        self._lock = threading.RLock()

    def watch(self, on_first: Callable[[], Any], on_none: Callable[[], Any]) -> None:
        """Call ``on_first()`` now if a comm is alive and whenever the count leaves 0, ``on_none()`` when it reaches 0."""
        with self._lock:
            self._on_first, self._on_none = on_first, on_none
            if self.count:
                on_first()

    def born(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == 1 and self._on_first is not None:
                self._on_first()

    def died(self) -> None:
        with self._lock:
            self.count -= 1
            if self.count == 0 and self._on_none is not None:
                self._on_none()


LIVE_COMMS = LiveComms()


@dataclass(frozen=True)
class DomainComm:
    """A domain group as plain data: the manager's axis it is (``"domain"``, a grid line ``"domain_0"``, or None
    for a one-rank domain), its members' global ranks in axis order, my index, and the mesh it belongs to.

    Plain, hashable data (no process group inside), so a domain tensor's spec can be compared, hashed and
    deep-copied, and torch.compile can guard on it; ``group`` looks the process group up by axis.
    """

    axis: str | None
    ranks: tuple[int, ...]
    index: int
    mesh_epoch: int = 0

    def __post_init__(self) -> None:
        # NOTE: a comm made while Dynamo traces is symbolic; the one the graph's caller gets is made again at run time
        if not torch.compiler.is_dynamo_compiling():
            object.__setattr__(self, "_alive", True)  # frozen: past the dataclass's own __setattr__
            LIVE_COMMS.born()

    def __del__(self) -> None:
        if self.__dict__.get("_alive") and LIVE_COMMS is not None:  # NOTE: None while the interpreter shuts down
            LIVE_COMMS.died()

    # NOTE: plain immutable data: a copy is the comm itself, and unpickling makes one through __init__, so every comm
    # alive is counted once (a copy made field by field would skip __post_init__ and be counted out but never in)
    def __copy__(self) -> DomainComm:
        return self

    def __deepcopy__(self, memo: dict) -> DomainComm:
        return self

    def __reduce__(self) -> tuple:
        return DomainComm, (self.axis, self.ranks, self.index, self.mesh_epoch)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def domain_index(self, q: int) -> int:
        """Member ``q``'s index on the domain axis (what messages call its domain rank; a grid line's index differs).

        Usage: ``f"domain rank {comm.domain_index(q)}"``
        """
        if self.axis in (None, "domain") or not DistributedManager.is_initialized():
            return q
        everyone = DistributedManager().axis_ranks("domain")
        return everyone.index(self.ranks[q]) if self.ranks[q] in everyone else q

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None for a one-rank domain); raises for a domain tensor of an earlier mesh."""
        if self.axis is None:
            return None
        return DistributedManager.group_of_epoch(self.axis, self.mesh_epoch)


def domain_groups() -> tuple[DomainComm, ...]:
    """This rank's domain group and, on a factored domain grid, its grid lines: every group a domain exchange may run
    on (none before the manager is initialized).

    Usage: ``for comm in domain_groups(): ...  # tell every peer this rank may be exchanging with``
    """
    if not DistributedManager.is_initialized():
        return ()
    dm = DistributedManager()
    names = ("domain",) + (tuple(f"domain_{i}" for i in range(len(dm.domain_grid))) if len(dm.domain_grid) > 1 else ())
    return tuple(DomainComm(n, tuple(dm.axis_ranks(n)), dm.axis_rank(n), dm.epoch) for n in names)
