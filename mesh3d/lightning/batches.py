"""Batches in and step outputs out of a LightningModule on a domain-sharded mesh.

In: ``MeshStrategy(domain_dims=...)`` splits the tensors of each batch over the ``domain`` axis
after Lightning moved it to the device (every rank of a domain group loads the same samples:
the sampler follows the batch axis). Out: a loss computed from domain tensors is a replicated
``DomainTensor``; Lightning's loops expect a plain tensor, so the step's output is unwrapped
(differentiably) before Lightning sees it.

Usage::

    shard_batch((x, y), dims=(2, 2))        # -> (domain.shard(x, dim=2), domain.shard(y, dim=2))
    shard_batch({"x": x, "t": t}, {"x": 2}) # tensors not named stay whole
    plain_step_output(loss)                 # replicated DomainTensor -> its local plain tensor
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch

from mesh3d import domain
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.specs import sharded_dims

__all__ = ["DomainDims", "check_domain_dims", "shard_batch", "plain_step_output"]

#: ``int`` (the dim of every tensor in the batch), a sequence aligned with a tuple/list batch
#: (``None`` entries stay whole) or a mapping from a dict batch's keys to dims.
DomainDims = Union[int, Sequence[Union[int, None]], Mapping[str, int]]


def check_domain_dims(dims: Any) -> None:
    """Refuse a ``domain_dims`` that is not an int, a sequence of ints/None or a str→int mapping."""
    ok = (
        dims is None
        or (isinstance(dims, int) and not isinstance(dims, bool))
        or (isinstance(dims, Mapping) and all(isinstance(k, str) and isinstance(v, int) for k, v in dims.items()))
        or (isinstance(dims, Sequence) and not isinstance(dims, str) and all(d is None or isinstance(d, int) for d in dims))
    )
    if not ok:
        raise TypeError(
            f"domain_dims={dims!r} must be an int (shard every batch tensor along that dim), a list aligned with "
            "the batch's tensors (None keeps one whole), or a dict {batch key: dim}"
        )


def _shard(t: Any, dim: int | None, where: str) -> Any:
    if dim is None or not isinstance(t, torch.Tensor) or isinstance(t, DomainTensor):
        return t
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"domain_dims asks to shard {where} (shape {tuple(t.shape)}) along dim {dim}, which it lacks")
    return domain.shard(t, dim=dim)


def shard_batch(batch: Any, dims: DomainDims | None) -> Any:
    """``batch`` with its tensors split over the domain axis as ``dims`` says (see :data:`DomainDims`)."""
    if dims is None:
        return batch
    if isinstance(dims, int):
        if isinstance(batch, Mapping):
            return type(batch)({k: _shard(v, dims, f"batch[{k!r}]") for k, v in batch.items()})  # type: ignore[call-arg]  # a dict subclass
        if isinstance(batch, (list, tuple)):
            return type(batch)(_shard(v, dims, f"batch[{i}]") for i, v in enumerate(batch))
        return _shard(batch, dims, "the batch")
    if isinstance(dims, Mapping):
        if not isinstance(batch, Mapping):
            raise TypeError(f"domain_dims is a dict ({dict(dims)}) but the batch is a {type(batch).__name__}, not a dict")
        unknown = sorted(set(dims) - set(batch))
        if unknown:
            raise KeyError(f"domain_dims names {unknown}, which the batch lacks (its keys: {sorted(batch)})")
        return type(batch)({k: _shard(v, dims.get(k), f"batch[{k!r}]") for k, v in batch.items()})  # type: ignore[call-arg]  # a dict subclass
    if not isinstance(batch, (list, tuple)) or len(batch) != len(dims):
        raise TypeError(f"domain_dims={list(dims)} needs a list/tuple batch of {len(dims)} items, got "
                        f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (list, tuple)) else ""))
    return type(batch)(_shard(v, d, f"batch[{i}]") for i, (v, d) in enumerate(zip(batch, dims)))


def _plain(value: Any, where: str) -> Any:
    if not isinstance(value, DomainTensor):
        return value
    if sharded_dims(value.spec):
        raise ValueError(
            f"{where} is still sharded over the domain axis (dims {sharded_dims(value.spec)}, global shape "
            f"{tuple(value.global_shape)}); reduce it first (e.g. F.mse_loss(...) or .mean()) or call .full_tensor()"
        )
    return value.to_local()


def plain_step_output(output: Any, step: str = "training_step") -> Any:
    """A step's output with replicated DomainTensors replaced by their (differentiable) local tensors."""
    if isinstance(output, Mapping):
        return type(output)({k: _plain(v, f"{step}()['{k}']") for k, v in output.items()})  # type: ignore[call-arg]
    return _plain(output, f"the value {step}() returned")
