"""``F.cross_entropy`` of rows merged under a batch: a language model's loss line on a sequence sharded along T.

Usage: automatic, through torch::

    logits = head(h)                                               # (B, T, V), T sharded over the domain
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))   # targets sharded like h along T, or plain (B*T,)

``logits.view(-1, V)`` is a strided layout (``DomainSpec.outer`` = B): each rank's rows are its tokens of every
sample. A row's loss is its own, so the per-row losses are local and a reduction is one sum over the domain (a
mean's denominator too: the rows not ignored, weighted by their class weights, as torch divides).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh3d.domain.comm.collectives import sum_dtype
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.registry import STRIDED_RULES
from mesh3d.domain.dispatch.step import Combining, Entering, Step
from mesh3d.domain.ops.composite import loss_reduction
from mesh3d.domain.ops.idioms import replicated_slice

__all__: list[str] = []


def _target_rows(target: torch.Tensor, input: DomainTensor) -> torch.Tensor:
    """This rank's rows of the target: laid out like the logits' rows, or plain with one row per global row."""
    spec, rows = input.spec, size_of(input)[0]
    if isinstance(target, DomainTensor) and target.spec.dim is not None:
        if (target.spec.dim, target.spec.sizes, target.spec.outer) == (0, spec.sizes, spec.outer):
            return unwrap(target)
    elif target.ndim >= 1 and target.shape[0] == rows:
        return replicated_slice(target, 0, input)
    raise ValueError(
        f"F.cross_entropy: the target must be laid out like the logits' {rows} rows: targets sharded like the sequence "
        "then flattened (domain.shard(targets, dim=1).view(-1)), or the plain targets of every row "
        f"(a tensor of {rows} rows)")


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    reduction = loss_reduction("F.cross_entropy", size_average, reduce, reduction)
    spec = input.spec
    if input.ndim != 2 or spec.dim != 0:
        raise NotImplementedError(
            "F.cross_entropy on a strided domain tensor takes (N, C) logits whose rows are the merged sharded dim "
            "(logits.view(-1, C)); reshape other shapes back to their unstrided shape first")
    rows = _target_rows(target, input)
    if reduction == "none":  # NOTE: one loss per row, laid out as the rows
        return adopt(F.cross_entropy(unwrap(input), rows, weight, ignore_index=ignore_index, reduction="none",
                                     label_smoothing=label_smoothing), spec)
    whole_rows = size_of(input)[0]

    def reduced(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None, combine: Callable) -> torch.Tensor:
        losses = F.cross_entropy(x, t, w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
        acc = sum_dtype(losses.dtype)
        total = combine(losses.sum(dtype=acc))
        if reduction == "mean":
            if t.is_floating_point():  # class probabilities: the mean over the rows
                total = total / whole_rows
            else:
                valid = (t != ignore_index).to(losses.dtype)
                counted = valid if w is None else w[t.clamp(min=0)] * valid
                total = total / combine(counted.sum(dtype=acc)).detach()
        return total.to(losses.dtype)

    w = Entering(weight) if isinstance(weight, DomainTensor) else weight  # replicated: its gradient summed
    return Step(reduced, (input, rows, w, Combining(spec.comm)), out=DomainSpec.replicated(spec.comm))


STRIDED_RULES.register(F.cross_entropy, _cross_entropy)
