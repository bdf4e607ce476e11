"""Dropout inside a tensor-parallel region: every model rank draws the one-process mask, keeps its own columns.

Usage (``parallelize`` installs it on every colwise/rowwise module; nothing to call)::

    dm.manual_seed(0)                          # one stream per batch rank, shared by its domain and model ranks
    h = F.dropout(F.gelu(up(x)), 0.1, True)    # up: colwise; h holds this rank's hidden units (its columns)
    y = down(h)                                # down: rowwise: the one-process output, mask included

Between a colwise module (its output sharded along the last dim over the model axis) and the next rowwise module,
each model rank holds other hidden units. A plain ``F.dropout`` there would draw the same numbers on every model
rank (they share one stream, as they must for everything replicated): one mask for different units, a correlated
dropout no single process draws. So from the colwise module's output to the rowwise module's input a
``TorchFunctionMode`` follows the column-sharded tensors (the output, and element-wise results of the same shape) and
runs dropout on them as one process would: the mask of the whole hidden width drawn from the shared stream (the same
numbers in the same order; on a domain tensor, through the domain's own dropout, which keeps this rank's rows), then
narrowed to this rank's columns. The generator stays in step across model ranks, and the result is exact.

Anything random on a tensor computed from the sharded hidden in another way (a view splitting heads, attention
scores, ``dropout_p`` of attention, ``bernoulli``, ``rand_like``) raises, naming the op: each model rank would draw
the same numbers for different heads or units. Draws that take no tensor (``torch.rand(b, 1, 1)`` for stochastic
depth) are replicated values and stay as they are.

NOTE: the mode is active only inside a region of a module in training mode on a model axis of more than one rank,
so evaluation and models without tensor parallelism pay nothing. Like the domain's dropout it draws the whole mask:
O(hidden) transient memory per rank (DTensor's offset-based RNG tracker avoids that only on CUDA, and its masks are
not the one-process ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from mesh3d.domain.dispatch.registry import op_name
from mesh3d.domain.core.tensor import DomainTensor, local_shape, wrap

__all__ = ["TP_REGION", "ColumnShard", "mark_regions"]

#: Dropouts whose mask the mode draws as one process does (``func(ones_of_whole_width, p, True)``).
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)
#: Random ops on a tensor argument that cannot be drawn per column here: refused on region tensors.
_RANDOM = (F.alpha_dropout, F.feature_alpha_dropout, F.rrelu, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
           torch.feature_alpha_dropout, torch.bernoulli, torch.Tensor.bernoulli, torch.Tensor.bernoulli_,
           torch.rand_like, torch.randn_like, torch.randint_like, torch.multinomial, torch.Tensor.multinomial,
           torch.poisson, torch.normal, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_,
           torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_)


@dataclass(frozen=True)
class ColumnShard:
    """This model rank's columns of a hidden tensor: ``local`` of ``full`` along the last dim, from ``offset``."""

    full: int
    offset: int
    local: int


class _RegionMode(TorchFunctionMode):
    """Follows column-sharded tensors through a region; dropout on them draws the one-process columns."""

    def __init__(self, region: _Region) -> None:
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors_in((args, kwargs))
        cols = self.region.cols
        marked = [t for t in tensors if t in cols]
        touched = bool(marked) or any(t in self.region.derived for t in tensors)
        if func in _DROPOUTS and marked and tensors[0] is marked[0]:
            return _dropout(func, cols[marked[0]], *args, **kwargs)
        if touched and (func in _DROPOUTS or func in _RANDOM or func is F.scaled_dot_product_attention) \
                and _draws(func, args, kwargs):
            raise NotImplementedError(
                f"{op_name(func)} inside a tensor-parallel region (after a colwise module, before its rowwise one) on a "
                "tensor computed from the sharded hidden units other than element-wise (a view splitting heads, "
                "attention scores, a reduction): every model rank would draw the same numbers for other units. "
                "Apply dropout to the colwise output or element-wise results of it (F.dropout), after the rowwise "
                "module, or use p=0 / model.eval() there")
        out = func(*args, **kwargs)
        if touched:
            self.region.follow(out, marked)
        return out


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts (read only: ``torch.Size`` arguments stay as they are)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return [t for o in obj for t in _tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_in(o)]
    return []


def _arg(args: tuple, kwargs: dict, at: int, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[at] if len(args) > at else default


#: Dropouts that draw only in training with p > 0: (the training flag's default, its keyword names).
_TRAINING = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: False,
             F.feature_alpha_dropout: False, torch.dropout: None, torch.alpha_dropout: None, torch.feature_dropout: None,
             torch.feature_alpha_dropout: None}


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers: dropout with p > 0 in training (HF's eager attention calls it with
    p=0.0), SDPA with ``dropout_p``, rrelu in training; bernoulli, rand_like and the rest always."""
    if func is F.scaled_dot_product_attention:
        return bool(_arg(args, kwargs, 4, ("dropout_p",), 0.0))
    if func is F.rrelu:
        return bool(_arg(args, kwargs, 3, ("training",), False))
    if func in _TRAINING:
        p = _arg(args, kwargs, 1, ("p",), 0.5)
        return bool(_arg(args, kwargs, 2, ("training", "train"), _TRAINING[func])) and p != 0
    return True


def _dropout(func, shard: ColumnShard, input, p=0.5, training=True, inplace=False):
    """``func`` on this rank's columns: the mask of the whole width (the one-process draw), narrowed."""
    if not training or p == 0:
        return input
    with torch.no_grad():
        if isinstance(input, DomainTensor):  # the domain's dropout keeps this rank's rows of the whole mask
            shape = (*local_shape(input)[:-1], shard.full)
            ones = wrap(torch.ones(shape, dtype=input.dtype, device=input.device), input._spec)
        else:
            ones = torch.ones((*input.shape[:-1], shard.full), dtype=input.dtype, device=input.device)
        mask = func(ones, p, True).narrow(-1, shard.offset, shard.local)
        if shard.local < shard.full:
            mask = mask.clone()  # NOTE: a narrowed view, saved for backward, kept the whole width's mask alive
    return input.mul_(mask) if inplace else input * mask


class _Region:
    """The one region state: whether a region is open (its mode pushed) and which tensors it follows."""

    def __init__(self) -> None:
        self.mode: _RegionMode | None = None
        self.cols: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.derived: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def begin(self, output: torch.Tensor, shard: ColumnShard) -> None:
        if self.mode is None:
            self.mode = _RegionMode(self)
            self.mode.__enter__()
        self.cols[output] = shard

    def end(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
            self.cols, self.derived = WeakTensorKeyDictionary(), WeakTensorKeyDictionary()

    def follow(self, out: Any, marked: list[torch.Tensor]) -> None:
        """Element-wise results (the local shape of the column-sharded inputs, one width) stay column-sharded; the
        rest computed from the hidden units is derived (random ops on it refuse)."""
        shards = {self.cols[t] for t in marked}
        shapes = {local_shape(t) for t in marked}
        for t in _tensors_in(out):
            if len(shards) == 1 and len(shapes) == 1 and local_shape(t) in shapes:
                self.cols[t] = next(iter(shards))
            else:
                self.derived[t] = True


#: The process's one region (a model forward runs one region at a time).
TP_REGION = _Region()


def _column_shard(module: nn.Module, output: torch.Tensor, model_rank: int, model_size: int) -> ColumnShard:
    weight = module.weight
    full = weight.shape[0] if isinstance(module, nn.Linear) else weight.shape[1]
    chunk = -(-full // model_size)  # DTensor's Shard: torch.chunk sizes
    offset = min(model_rank * chunk, full)
    local = local_shape(output)[-1]
    if local != max(0, min(chunk, full - offset)):
        raise RuntimeError(f"{type(module).__name__}: its colwise output holds {local} of {full} columns; expected "
                           f"{max(0, min(chunk, full - offset))} at model rank {model_rank} of {model_size}")
    return ColumnShard(full, offset, local)


def mark_regions(model: nn.Module, styles: dict[str, ParallelStyle], model_rank: int, model_size: int) -> None:
    """Open a region at each colwise module's output (sharded along the last dim), close it at each rowwise module's
    input, and at the end of ``model``'s forward (a region no rowwise module closed, or a forward that raised)."""
    if model_size == 1:
        return

    def opened(mod: nn.Module, _args: tuple, output: Any) -> None:
        if mod.training and isinstance(output, torch.Tensor):
            TP_REGION.begin(output, _column_shard(mod, output, model_rank, model_size))

    opens = False
    for fqn, style in styles.items():
        module = model.get_submodule(fqn)
        if isinstance(style, ColwiseParallel) and style.output_layouts == (Shard(-1),) and style.use_local_output \
                and isinstance(module, (nn.Linear, nn.Embedding)):
            module.register_forward_hook(opened)
            opens = True
        elif isinstance(style, RowwiseParallel):
            module.register_forward_pre_hook(lambda _mod, _args: TP_REGION.end(), prepend=True)
    if opens:
        model.register_forward_hook(lambda *_: TP_REGION.end(), always_call=True)
