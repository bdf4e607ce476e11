"""The domain group as plain data (``DomainComm``): which manager axis, its members' global ranks, my index.

Usage: ``comm = DomainComm("domain", (0, 2), 1, epoch); comm.size, comm.group``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mesh3d.manager import DistributedManager

__all__ = ["DomainComm"]


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

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None for a one-rank domain); raises for a domain tensor of an earlier mesh."""
        if self.axis is None:
            return None
        return DistributedManager.group_of_epoch(self.axis, self.mesh_epoch)
