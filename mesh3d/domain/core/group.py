"""The domain group as plain data (``DomainComm``): which manager axis, its members' global ranks, my index.

Usage: ``comm = DomainComm("domain", (0, 2), 1, epoch); comm.size, comm.group``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mesh3d.manager import DistributedManager

__all__ = ["DomainComm", "domain_groups"]


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
