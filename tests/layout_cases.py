"""The layout sweep's inputs (``test_domain_layout_sweep.py``): a value in each layout a domain tensor can have, and
calls of every ruled torch function on it.

``LAYOUTS`` name how a (2, 3, N, 4) fp64 tensor is laid out: a slab along dim 2 (uneven, empty and one-row shards as
the sizes say), the same value replicated (``full_tensor``), a strided slab (``view(-1, 4)`` merging the sharded dim
under the dims before it), blocks of dims (2, 3) on a 2-D grid, blocks of dims (1, 2, 3) on a 3-D grid, and a token grid
(2-D blocks flattened into tokens), and graph items: the N rows of dim 2 as nodes of a partition whose owners interleave along
the ids (``interleaved``: the counts as the sizes say). ``calls(func, x, y)`` makes argument lists for one torch function: from the
schema of the ATen operator of its name (``operator_cases``), and from ``RECIPES`` for the functions whose Python
arguments differ (convolutions, pooling, norms, interpolation, attention ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from operator_cases import SKIP_NAMES, calls as schema_calls
from sphere_cases import sphere_recipes

LAYOUTS = ("slab", "replicated", "strided", "blocks2", "blocks3", "tokens", "graph")


def make(layout: str, x: torch.Tensor, sizes: Any) -> Any:
    """``x`` (whole, the same on every rank) laid out as ``layout`` on the current mesh."""
    from mesh3d import domain

    if layout == "slab":
        return domain.shard(x, dim=2, sizes=sizes)
    if layout == "replicated":
        return domain.shard(x, dim=2, sizes=sizes).full_tensor()
    if layout == "strided":
        return domain.shard(x, dim=2, sizes=sizes).view(-1, x.shape[-1])
    if layout == "blocks2":
        return domain.shard(x, dims=(2, 3), sizes=sizes)
    if layout == "blocks3":
        return domain.shard(x, dims=(1, 2, 3), sizes=sizes)
    if layout == "tokens":
        return domain.shard(x, dims=(2, 3), sizes=sizes).flatten(2).transpose(1, 2)
    if layout == "graph":
        return domain.shard_nodes(x, interleaved(sizes), dim=2)
    raise ValueError(layout)


def interleaved(counts: Any) -> Any:
    """A partition holding ``counts[r]`` items on rank ``r``, dealt round the ranks that still have room (owners
    interleave along the ids, as a real partition's do; an empty part holds none)."""
    from mesh3d import graphs

    left, owner = list(counts), []
    while any(left):
        for r, k in enumerate(left):
            if k:
                owner.append(r)
                left[r] -= 1
    return graphs.Partition(owner, len(counts))


def plain(layout: str, x: torch.Tensor) -> torch.Tensor:
    """The one-process value ``make`` lays out."""
    if layout == "strided":
        return x.view(-1, x.shape[-1])
    if layout == "tokens":
        return x.flatten(2).transpose(1, 2)
    return x


def aten_name(func: Callable) -> str | None:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or name.startswith("__") or name in SKIP_NAMES:
        return None
    return name


def _w(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))


#: Calls of the functions whose Python arguments an ATen schema does not give; ``x`` is a 4-D (or, for a token
#: grid or a strided slab, 3-D / 2-D) value, ``y`` laid out alike.
RECIPES: dict[Callable, list[Callable[[Any, Any], Any]]] = {
    F.conv2d: [lambda x, y: F.conv2d(x, _w(2, x.shape[1], 3, 3), padding=1),
               lambda x, y: F.conv2d(x, _w(2, x.shape[1], 2, 2), stride=2)],
    F.conv1d: [lambda x, y: F.conv1d(x.flatten(0, 1) if x.ndim == 4 else x, _w(2, x.shape[-2] if x.ndim != 4
                                                                               else x.shape[2], 3), padding=1)],
    F.conv_transpose2d: [lambda x, y: F.conv_transpose2d(x, _w(x.shape[1], 2, 2, 2), stride=2)],
    F.unfold: [lambda x, y: F.unfold(x, 3, padding=1), lambda x, y: F.unfold(x, (2, 3), stride=(2, 1))],
    F.fold: [lambda x, y: F.fold(F.unfold(x, 3, padding=1), x.shape[-2:], 3, padding=1)],
    F.grid_sample: [lambda x, y: F.grid_sample(x, torch.tanh(x[:, :2]).permute(0, 2, 3, 1) * 1.2, align_corners=False),
                    lambda x, y: F.grid_sample(x, torch.tanh(x[:, :2]).permute(0, 2, 3, 1) * 1.2, mode="bicubic",
                                               padding_mode="reflection", align_corners=True)],
    F.max_pool2d: [lambda x, y: F.max_pool2d(x, 2), lambda x, y: F.max_pool2d(x, 3, stride=1, padding=1)],
    F.avg_pool2d: [lambda x, y: F.avg_pool2d(x, 2, ceil_mode=True)],
    F.adaptive_avg_pool2d: [lambda x, y: F.adaptive_avg_pool2d(x, (2, 3)), lambda x, y: F.adaptive_avg_pool2d(x, 1)],
    F.adaptive_max_pool2d: [lambda x, y: F.adaptive_max_pool2d(x, (3, 2))],
    F.adaptive_avg_pool1d: [lambda x, y: F.adaptive_avg_pool1d(x.flatten(2), 1), lambda x, y: F.adaptive_avg_pool1d(
        x.flatten(2).transpose(1, 2), 2), lambda x, y: F.adaptive_avg_pool1d(x.flatten(2), 3)],
    torch.flip: [lambda x, y: torch.flip(x, (2,)), lambda x, y: x.flip(-1, -2)],
    F.group_norm: [lambda x, y: F.group_norm(x, 3 if x.ndim == 4 else 1, _w(x.shape[1]), _w(x.shape[1]))],
    F.layer_norm: [lambda x, y: F.layer_norm(x, x.shape[-1:]), lambda x, y: F.layer_norm(x, x.shape[-2:])],
    F.batch_norm: [lambda x, y: F.batch_norm(x, None, None, training=True)],
    F.instance_norm: [lambda x, y: F.instance_norm(x)],
    F.interpolate: [lambda x, y: F.interpolate(x, scale_factor=2, mode="nearest"),
                    lambda x, y: F.interpolate(x, scale_factor=2, mode="bilinear"),
                    lambda x, y: F.interpolate(x, size=(5, 3), mode="bilinear", align_corners=True)],
    F.pad: [lambda x, y: F.pad(x, (1, 1, 2, 2)), lambda x, y: F.pad(x, (1, 1, 1, 1), mode="reflect"),
            lambda x, y: F.pad(x, (2, 2, 1, 1), mode="circular"), lambda x, y: F.pad(x, (1, 0, 1, 0), mode="replicate")],
    F.scaled_dot_product_attention: [lambda x, y: F.scaled_dot_product_attention(x, y, y),
                                     lambda x, y: F.scaled_dot_product_attention(x, x, y, is_causal=True)],
    F.linear: [lambda x, y: F.linear(x, _w(5, x.shape[-1]), _w(5))],
    F.embedding: [lambda x, y: F.embedding((x.abs() * 3).long() % 4, _w(4, 3))],
    F.cross_entropy: [lambda x, y: F.cross_entropy(x, (y.abs() * 3).long() % x.shape[1])],
    F.mse_loss: [lambda x, y: F.mse_loss(x, y), lambda x, y: F.mse_loss(x, y, reduction="none")],
    F.l1_loss: [lambda x, y: F.l1_loss(x, y, reduction="sum")],
    F.softmax: [lambda x, y: F.softmax(x, dim=-1), lambda x, y: F.softmax(x, dim=2 % x.ndim)],
    F.log_softmax: [lambda x, y: F.log_softmax(x, dim=1)],
    F.dropout: [lambda x, y: F.dropout(x, 0.5, training=False)],
    torch.functional.einsum: [lambda x, y: torch.einsum("...i,...i->...", x, y)],
    torch.matmul: [lambda x, y: x @ y.transpose(-1, -2), lambda x, y: x @ _w(x.shape[-1], 2)],
    torch.Tensor.__getitem__: [lambda x, y: x[:, 1], lambda x, y: x[..., 1:3], lambda x, y: x[0]],
    torch.cat: [lambda x, y: torch.cat([x, y], 1), lambda x, y: torch.cat([x, y], -1)],
    torch.stack: [lambda x, y: torch.stack([x, y], 0)],
    torch.roll: [lambda x, y: torch.roll(x, 2, -2), lambda x, y: torch.roll(x, (1, -1), (1, -1))],
    torch.Tensor.reshape: [lambda x, y: x.reshape(x.shape[0], -1), lambda x, y: x.reshape(*x.shape[:-1], 2, -1)],
    torch.Tensor.view: [lambda x, y: x.view(x.shape[0], -1), lambda x, y: x.view(-1)],
    torch.Tensor.permute: [lambda x, y: x.permute(*reversed(range(x.ndim)))],
    torch.Tensor.transpose: [lambda x, y: x.transpose(-1, -2), lambda x, y: x.transpose(0, 1)],
    torch.Tensor.expand_as: [lambda x, y: x.sum(-1, keepdim=True).expand_as(y)],
    torch.Tensor.unfold if hasattr(torch.Tensor, "unfold") else torch.Tensor.view: [lambda x, y: x.unfold(-1, 2, 1)],
    torch.fft.rfftn: [lambda x, y: torch.fft.rfftn(x, dim=(-2, -1)), lambda x, y: torch.fft.rfft(x)],
    torch.cumsum: [lambda x, y: torch.cumsum(x, -2), lambda x, y: torch.cumsum(x, 0)],
}
RECIPES.update(sphere_recipes())  # torch-harmonics' kernels: the rules mesh3d ships for it (the sweep loads them)


def calls(func: Callable, x: torch.Tensor, y: torch.Tensor, sharded_dim: int) -> Iterator[Callable[[Any, Any], Any]]:
    """Calls ``f(x, y)`` of ``func`` for the sweep: its recipes, and those made from its ATen twin's schemas."""
    yield from RECIPES.get(func, ())
    name = aten_name(func)
    packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None:
        return
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if "out" in overload or torch.Tag.nondeterministic_seeded in op.tags:
            continue
        for args, kwargs in schema_calls(op, x, y, sharded_dim, limit=2):
            yield _bound(func, args, kwargs, x, y)


def _bound(func: Callable, args: tuple, kwargs: dict, x: torch.Tensor, y: torch.Tensor) -> Callable[[Any, Any], Any]:
    """The call ``func(*args, **kwargs)`` with ``x`` and ``y`` standing for the values it will be given."""
    def swap(o: Any, a: Any, b: Any) -> Any:
        if o is x:
            return a
        if o is y:
            return b
        if isinstance(o, (list, tuple)):
            return type(o)(swap(v, a, b) for v in o)
        return o

    return lambda a, b: func(*swap(args, a, b), **{k: swap(v, a, b) for k, v in kwargs.items()})
