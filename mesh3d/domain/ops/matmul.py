"""``matmul``/``@``/``bmm`` with domain tensors: attention written by hand (``q @ k.transpose(-1, -2)``, ``p @ v``).

Usage: automatic; ``scores = q @ k.transpose(-1, -2)`` with ``q`` and ``k`` sharded along the token dim
gives this rank's rows of the one-process scores (all keys gathered), and ``probs @ v`` likewise.

The left operand's rows (dim -2) or a batch dim may be sharded; the right operand, when sharded
at all, is gathered whole (its gradient goes back to its owners and is added there: the exact
adjoint). A sharded contraction dim on the left operand would need partial sums and is refused.
"""

from __future__ import annotations

import torch

from mesh3d.domain.dispatch.registry import op_name, register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.dispatch.step import Entering, Rows, Step
from mesh3d.domain.core.tensor import DomainTensor

__all__: list[str] = []


def _whole(t):
    """A right operand usable by every rank's rows: gathered whole when sharded, summed-gradient when replicated."""
    if not isinstance(t, DomainTensor):
        return t
    if t.spec.dim is None:
        return Entering(t)
    n = sum(t.spec.sizes)
    return Rows(t, tuple((Span.rows(0, n),) for _ in t.spec.sizes))


def matmul_rule(func):
    def rule(input, other, *, out=None) -> Step:
        a_sharded = isinstance(input, DomainTensor) and input.spec.dim is not None
        if a_sharded:
            if input.ndim < 2 or input.spec.dim == input.ndim - 1:
                raise NotImplementedError(
                    f"{op_name(func)}: the left operand is sharded along its contraction dim {input.spec.dim}; "
                    "shard its rows (dim -2) or a batch dim, or call .full_tensor() first"
                )
            out_ndim = max(input.ndim, getattr(other, "ndim", 2))
            new_dim = input.spec.dim + out_ndim - input.ndim
            if input.spec.dim < input.ndim - 2 and isinstance(other, DomainTensor) and other.spec.dim is not None \
                    and other.ndim - other.spec.dim == input.ndim - input.spec.dim:
                return Step(func, (input, other), out=input.spec.with_sizes(input.spec.sizes, dim=new_dim))
            return Step(func, (input, _whole(other)), out=input.spec.with_sizes(input.spec.sizes, dim=new_dim))
        if isinstance(other, DomainTensor) and other.spec.dim == other.ndim - 1 and other.ndim >= 2:
            out_ndim = max(other.ndim, getattr(input, "ndim", 2))
            return Step(func, (Entering(input) if isinstance(input, DomainTensor) else input, other),
                        out=other.spec.with_sizes(other.spec.sizes, dim=out_ndim - 1))
        raise NotImplementedError(
            f"{op_name(func)}: the right operand is sharded along a dim other than its columns while the left "
            "is not sharded; call .full_tensor() first"
        )

    return rule


for _f in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm):
    register(_f)(matmul_rule(_f))
