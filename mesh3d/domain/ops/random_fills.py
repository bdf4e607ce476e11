"""Random fills and ``nn.init`` on domain tensors: the one-process draw, this rank's part of it.

Usage: automatic, after ``DistributedManager.manual_seed(seed)`` (a sample's domain ranks then share one stream)::

    nn.init.trunc_normal_(xs, std=0.02)     # a learned positional field sharded like the tokens it is added to
    noise = torch.randn_like(xs)            # diffusion noise: the numbers torch.randn_like(x) draws in one process

Every domain rank draws the whole tensor's numbers (the same call, shape, dtype and generator as one process) and keeps
its rows (slabs), its block (blocks) or its tokens (token grids), as dropout does (``random_ops``), so the generators
stay in step across the domain and the values are exact. ``nn.init``'s functions that check for ``__torch_function__``
(``uniform_``, ``normal_``, ``constant_``, ``kaiming_uniform_``) are torch's formulas on the global sizes; the others
reach the in-place fills below. NOTE: O(global) transient memory per rank, as dropout's masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mesh3d.domain.core.specs import BlockSpec, TokenSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, TOKEN_RULES, op_name
from mesh3d.domain.ops.composite import call

__all__ = ["rank_part"]

_TABLES = (RULES, BLOCK_RULES, TOKEN_RULES)


def rank_part(whole: torch.Tensor, like: DomainTensor) -> torch.Tensor:
    """This rank's part of ``whole``, a plain tensor of ``like``'s global shape: its rows, block or tokens.

    Usage: ``local.copy_(rank_part(torch.randn(xs.shape), xs))``
    """
    spec = like._spec
    if isinstance(spec, BlockSpec):
        for dim, offset, rows in zip(spec.dims, spec.offsets, spec.local_sizes):
            whole = whole.narrow(dim, offset, rows)
        return whole
    if isinstance(spec, TokenSpec):
        return whole.index_select(spec.token_dim, spec.global_index.to(whole.device))
    return whole.narrow(spec.dim, spec.offset, spec.sizes[spec.comm.index])


def _whole_like(input: DomainTensor) -> torch.Tensor:
    local = unwrap(input)
    return torch.empty(size_of(input), dtype=local.dtype, device=local.device)


def _fill_rule(method: Callable) -> Callable:
    """``x.normal_(...)`` and the other in-place draws: the whole tensor drawn, this rank's part written."""
    def rule(input: DomainTensor, *args: Any, **kwargs: Any) -> DomainTensor:
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise NotImplementedError(f"{op_name(method)} with a tensor argument on a domain tensor is not supported; "
                                      "pass numbers (the one-process draw), or call it on x.full_tensor()")
        whole = _whole_like(input)
        method(whole, *args, **kwargs)  # the one-process call: same numbers from the same generator state
        # NOTE: a copy, as torch's fill: no gradient reaches what it overwrites (a leaf that needs one refuses it)
        unwrap(input).copy_(rank_part(whole, input))
        return input

    return rule


for _method in (torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
                torch.Tensor.random_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.geometric_):
    for _table in _TABLES:
        _table.register(_method, _fill_rule(_method))


def _like_rule(func: Callable, draw: Callable) -> Callable:
    """``torch.randn_like(xs)`` and the others: ``draw(shape, ...)`` of the whole shape, this rank's part, laid out
    like ``xs``."""
    def rule(input: DomainTensor, *args: Any, dtype: Any = None, layout: Any = None, device: Any = None,
             requires_grad: bool = False, memory_format: Any = torch.preserve_format, **kwargs: Any) -> DomainTensor:
        if layout not in (None, torch.strided) or memory_format not in (torch.preserve_format, torch.contiguous_format):
            raise NotImplementedError(f"{op_name(func)}(layout=, memory_format=) on a domain tensor: only the defaults")
        local = unwrap(input)
        whole = draw(*args, size_of(input), dtype=dtype or local.dtype, device=device or local.device, **kwargs)
        part = rank_part(whole, input).clone()
        return adopt(part.requires_grad_() if requires_grad else part, input._spec)

    return rule


def _randint(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.randint(low, high, size)`` with ``randint_like``'s argument order (bounds first, then the size)."""
    *bounds, size = args
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds
    return torch.randint(low, high, size, **kwargs)


for _func, _draw in ((torch.rand_like, torch.rand), (torch.randn_like, torch.randn), (torch.randint_like, _randint)):
    for _table in _TABLES:
        _table.register(_func, _like_rule(_func, _draw))


# ----------------------------------------------------------------------------- nn.init's torch-function entries
def _uniform(tensor: DomainTensor, a: float = 0.0, b: float = 1.0, generator: Any = None) -> DomainTensor:
    with torch.no_grad():
        return call(torch.Tensor.uniform_, tensor, a, b, generator=generator)


def _normal(tensor: DomainTensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> DomainTensor:
    with torch.no_grad():
        return call(torch.Tensor.normal_, tensor, mean, std, generator=generator)


def _constant(tensor: DomainTensor, val: float) -> DomainTensor:
    with torch.no_grad():
        return call(torch.Tensor.fill_, tensor, val)


def _fan(shape: torch.Size, mode: str) -> int:
    """``nn.init``'s fan on the global shape: dim 1 (fan in) or dim 0 (fan out) times the receptive field."""
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions")
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    receptive = math.prod(shape[2:])
    return (shape[1] if mode == "fan_in" else shape[0]) * receptive


def _kaiming_uniform(tensor: DomainTensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator: Any = None) -> DomainTensor:
    shape = size_of(tensor)
    if 0 in shape:
        return tensor
    bound = math.sqrt(3.0) * nn.init.calculate_gain(nonlinearity, a) / math.sqrt(_fan(shape, mode))
    return _uniform(tensor, -bound, bound, generator)


for _func, _rule in ((nn.init.uniform_, _uniform), (nn.init.normal_, _normal), (nn.init.constant_, _constant),
                     (nn.init.kaiming_uniform_, _kaiming_uniform)):
    for _table in _TABLES:
        _table.register(_func, _rule)
