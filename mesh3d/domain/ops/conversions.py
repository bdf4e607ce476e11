"""``t.to(x)`` and ``t.type_as(x)`` where ``t`` is plain and ``x`` a domain tensor: a conversion, not an operand.

Usage: automatic: ``rel_pos_emb.to(q)`` (Conformer) converts the plain table to ``q``'s dtype and device and leaves it
plain, as in one process. The element-wise rule would otherwise read ``x`` as an operand and slice the plain tensor
along a dim of the sharded dim's global length: silently wrong rows.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, STRIDED_RULES, TOKEN_RULES
from mesh3d.domain.ops import blocks, pointwise, strided, tokens  # noqa: F401  (their rules, replaced here for these two)

__all__: list[str] = []


def _converting(func, table):
    elementwise = table.get(func)

    def rule(*args, **kwargs):
        if args and not isinstance(args[0], DomainTensor):  # a plain tensor converted like a domain one: plain
            return func(args[0], *(unwrap(a) for a in args[1:]), **{k: unwrap(v) for k, v in kwargs.items()})
        return elementwise(*args, **kwargs)

    return rule


for _table in (RULES, STRIDED_RULES, BLOCK_RULES, TOKEN_RULES):
    for _f in (torch.Tensor.to, torch.Tensor.type_as):
        if _table.get(_f) is not None:
            _table.register(_f, _converting(_f, _table), override=True)
