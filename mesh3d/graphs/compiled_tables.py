"""A graph's index tables (a partition's owners and rows, a halo plan's rows) inside a compiled graph.

Usage::

    rows = table(part.tensor("owner"))       # the tensor itself; while torch.compile traces, an op returning it

Under ``torch.compile`` the rules of graph tensors run on fake shards, and a real tensor that a Python object holds
(a ``Partition``'s owners, a ``HaloPlan``'s rows) cannot meet them: fake tensor propagation refuses real inputs, and a
table made while it runs would be fake for good. ``mesh3d::graph_table`` is an op without inputs that returns the
table when the graph runs; the graph holds only its key, a small int. Its fake implementation knows the table's
shape and dtype.

NOTE: a table given a key is kept for the life of the process (the graph holds the key, not the tensor); the
partitions and plans that hold them are kept that long anyway (``Graph``'s plans, ``Partition``'s tensors).
"""

from __future__ import annotations

import torch

__all__ = ["graph_table", "table"]


class _Tables:
    """Tensors under small int keys, by identity."""

    def __init__(self) -> None:
        self._keys: dict[int, int] = {}
        self._tensors: list[torch.Tensor] = []

    def key(self, t: torch.Tensor) -> int:
        at = self._keys.get(id(t))
        if at is None or self._tensors[at] is not t:
            at = self._keys[id(t)] = len(self._tensors)
            self._tensors.append(t)
        return at

    def __getitem__(self, key: int) -> torch.Tensor:
        return self._tensors[key]


_TABLES = _Tables()


@torch.library.custom_op("mesh3d::graph_table", mutates_args=())
def graph_table(key: int) -> torch.Tensor:
    """The table kept under ``key`` (a copy: a compiled graph owns its ops' outputs)."""
    return _TABLES[key].clone()


@graph_table.register_fake
def _(key: int) -> torch.Tensor:
    kept = _TABLES[key]
    return torch.empty(kept.shape, dtype=kept.dtype, device=kept.device)


def table(t: torch.Tensor) -> torch.Tensor:
    """``t``, a real index table kept for the process's life; while ``torch.compile`` traces, ``graph_table``'s
    output, which is ``t``'s values when the graph runs.

    Usage: ``owner = table(part.tensor("owner"))``
    """
    if not torch.compiler.is_compiling():
        return t
    return graph_table(_TABLES.key(t))
