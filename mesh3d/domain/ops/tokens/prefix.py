"""Class tokens on a token grid: ``torch.cat([cls, t], 1)``, ``t[:, 0]`` and ``t[:, 1:]``.

Usage (through torch)::

    t = torch.cat([self.cls.expand(b, -1, -1), t], dim=1)   # prefix tokens: global positions 0.., on domain rank 0
    logits = head(t[:, 0])                                    # replicated on every rank
    g = t[:, 1:].transpose(1, 2).reshape(b, c, h, w)          # the grid again

Prefix tokens live on domain rank 0 before its block's tokens (``TokenSpec.prefix``); the global
order is the prefix, then the grid row-major, so ``pos_embedding`` of shape ``(1, 1 + N, C)`` lines up.
"""

from __future__ import annotations


import torch

from mesh3d.domain.ops.grid_reshape import untouched_index
from mesh3d.domain.dispatch.registry import TOKEN_RULES
from mesh3d.domain.dispatch.step import Entering, PrefixTokens, Step
from mesh3d.domain.core.specs import DomainSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.core.specs import TokenSpec

__all__: list[str] = []


def _cat(tensors, dim=0):
    grids = [i for i, t in enumerate(tensors) if isinstance(t, DomainTensor) and isinstance(t._spec, TokenSpec)]
    ref = tensors[grids[0]]
    spec = ref._spec
    assert isinstance(spec, TokenSpec)
    if spec.keys is not None:
        raise NotImplementedError("torch.cat of attention scores of a token grid is not supported")
    d = dim % ref.ndim
    if d != spec.token_dim:
        if len(grids) != len(tensors) or any(tensors[i]._spec != spec for i in grids):
            raise NotImplementedError("torch.cat on token grids along another dim than the tokens: every input must "
                                      "be a token grid laid out alike")
        return adopt(torch.cat([unwrap(t) for t in tensors], d), spec)
    if grids != [len(tensors) - 1]:
        raise NotImplementedError(
            "torch.cat along the token dim of a token grid: only whole tensors before ONE token grid (class or "
            "register tokens, torch.cat([cls, t], dim)) are supported; call .full_tensor() first otherwise")
    mine = spec.comm.index == 0
    for t in tensors[:-1]:
        if isinstance(t, DomainTensor) and sharded_dims(t._spec):
            raise ValueError("torch.cat: a token grid can only be joined with plain or replicated tensors")

    def joined(*ts):  # NOTE: ranks other than 0 take a zero-row slice: the piece's gradient (its domain sum) is there
        return torch.cat([*(t if mine else t.narrow(d, 0, 0) for t in ts[:-1]), ts[-1]], d)

    added = sum(t.shape[d] for t in tensors[:-1])
    pieces = tuple(Entering(t) if isinstance(t, DomainTensor) else t for t in tensors[:-1])
    return Step(joined, (*pieces, ref), out=spec.with_prefix(spec.prefix + added),
                keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


def _getitem(x: DomainTensor, index):
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    if spec.keys is not None:
        raise NotImplementedError("indexing attention scores of a token grid is not supported")
    moved = untouched_index(index, x.ndim, (spec.token_dim,))
    if moved is not None:  # the tokens whole (qkv[0] before them, t[..., :c] after): local
        return adopt(unwrap(x)[index], spec.moved(moved))
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (x.ndim - len(items) + 1)
    if len(items) <= spec.token_dim or any(i is None or not isinstance(i, (int, slice)) for i in items):
        raise NotImplementedError(
            f"torch.Tensor.__getitem__ on a token grid (tokens along dim {spec.token_dim}) supports ints and slices "
            "with an int or slice at the token dim (t[:, 0], t[:, 1:]); call .full_tensor() first otherwise")
    if any(i != slice(None) for i in items[:spec.token_dim]):
        raise NotImplementedError("torch.Tensor.__getitem__ on a token grid: index the dims before the tokens with : "
                                  "only")
    item, rest = items[spec.token_dim], tuple(items[spec.token_dim + 1:])
    local = unwrap(x)
    lead = (slice(None),) * spec.token_dim
    if isinstance(item, int):
        pos = item + spec.global_tokens if item < 0 else item
        if not 0 <= pos < spec.prefix:
            raise NotImplementedError(f"t[..., {item}] on a token grid: only prefix tokens (positions < {spec.prefix}) "
                                      "can be taken by index; gather grid tokens with .full_tensor()")
        d = spec.token_dim
        return Step(lambda taken: taken.select(d, 0)[lead + rest] if rest else taken.select(d, 0),
                    (PrefixTokens(x, pos, pos + 1),), out=DomainSpec.replicated(spec.comm))
    start, stop, step = item.indices(spec.global_tokens)
    if step != 1 or stop != spec.global_tokens or start > spec.prefix:
        if (start, stop, step) == (0, spec.global_tokens, 1):
            return adopt(local[lead + (slice(None),) + rest], spec)
        raise NotImplementedError(f"t[..., {item.start}:{item.stop}:{item.step}] on a token grid: only dropping "
                                  f"prefix tokens (t[:, k:] with k <= {spec.prefix}) is supported")
    kept = local.narrow(spec.token_dim, start, local.shape[spec.token_dim] - start) if spec.comm.index == 0 else local
    return adopt(kept[lead + (slice(None),) + rest], spec.with_prefix(spec.prefix - start))


for _f in (torch.cat, torch.concat):
    TOKEN_RULES.register(_f, _cat)
TOKEN_RULES.register(torch.Tensor.__getitem__, _getitem)
