"""``torch.fft.*`` along sharded dims, exact: move the sharding to a dim the transform leaves alone, transform, move back.

Usage: automatic; ``torch.fft.rfftn(xs, dim=(-2, -1))`` with ``xs`` sharded along dim 2 gives the
one-process spectrum (``torch.fft.fftshift``/``ifftshift`` likewise, the sizes kept), sharded along
dim 2 (``torch.chunk`` sizes of its new length when the transform changes it,
e.g. ``rfft`` halving the last dim or ``s=``; the original sizes otherwise).

The transformed dims must be whole on a rank, so the sharding is first moved (``transpose.move_sharding``,
an all-to-all with uneven shards) to the largest dim outside the transform (batch or channels;
ranks beyond its length hold empty shards), the op runs unchanged on the local block, and the
result is moved back. Transforms over every dim have no such dim and raise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.dispatch.step import Moved, Step
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap

__all__: list[str] = []

# name -> 1 (a 1-D transform, dim=-1 by default), 2 (dims (-2, -1)) or 0 (n-D: the last len(s) dims or all).
FFT_OPS = {
    "fft": 1, "ifft": 1, "rfft": 1, "irfft": 1, "hfft": 1, "ihfft": 1,
    "fft2": 2, "ifft2": 2, "rfft2": 2, "irfft2": 2, "hfft2": 2, "ihfft2": 2,
    "fftn": 0, "ifftn": 0, "rfftn": 0, "irfftn": 0, "hfftn": 0, "ihfftn": 0,
}


def global_sizes(size):
    """``n=``/``s=`` of a transform as plain ints: global lengths, as in one process (``s=x.shape[-2:]`` reads them).

    Usage: ``s = global_sizes(s)``
    """
    if size is None or isinstance(size, int):
        return None if size is None else int(size)
    return type(size)(int(v) for v in size) if isinstance(size, (list, tuple)) else size


def transformed_dims(kind: int, ndim: int, dim, s) -> list[int]:
    if kind == 1:
        return [(dim if dim is not None else -1) % ndim]
    if dim is None:
        if kind == 2:
            return [ndim - 2, ndim - 1]
        return list(range(ndim - len(s), ndim)) if s is not None else list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % ndim for d in dims]


def _check_free(op: str, x: DomainTensor, dims: list[int]) -> None:
    if not [d for d in range(x.ndim) if d not in dims]:
        raise NotImplementedError(
            f"{op} over every dim of a domain tensor sharded along dim {x.spec.dim}: no dim is left to hold the "
            "sharding while the transformed dims are whole; keep the batch or channel dim out of dim="
        )


def on_maybe_empty(local_op: Callable[[torch.Tensor], torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """``local_op(local)``; on an empty pencil (a nested split left this rank no slice) its zeros of the right
    shape, still connected to ``local`` (the FFT libraries refuse empty inputs).

    Usage: ``out = on_maybe_empty(lambda t: torch.fft.rfftn(t, dim=(-2, -1)), local)``
    """
    if local.numel():
        return local_op(local)
    meta = local_op(torch.empty(local.shape, dtype=local.dtype, device="meta"))
    # the (empty) input's sum is 0: added to keep autograd's path to it, as a real number so that a real
    # result (irfft of a complex spectrum) stays real and its messages keep the size the peers expect
    connect = local.abs().sum()
    return torch.zeros(meta.shape, dtype=meta.dtype, device=local.device) + connect


def _whole_along(x: DomainTensor, dims: list[int], local_op) -> Step:
    """The step of ``local_op`` on blocks where ``dims`` are whole: the sharding parked on the largest other dim
    (``step.Moved``) and moved back (``laid_out_as``): the original sizes when the sharded dim keeps its length,
    ``torch.chunk`` sizes of its new length otherwise (read from the op on a meta tensor of the whole's shape)."""
    spec, shape = x.spec, tuple(size_of(x))
    comm = spec.comm
    park = max((d for d in range(x.ndim) if d not in dims), key=lambda d: shape[d])
    parked = split_sizes(shape[park], comm.size)
    n_out = local_op(torch.empty(shape, dtype=unwrap(x).dtype, device="meta")).shape[spec.dim]
    sizes = spec.sizes if n_out == sum(spec.sizes) else split_sizes(n_out, comm.size)
    return Step(lambda t: on_maybe_empty(local_op, t), (Moved(x, park, parked),), out=DomainSpec(spec.dim, sizes, comm, 1),
                laid_out_as=DomainSpec(park, parked, comm, 1))  # NOTE: the parked dim may leave a rank nothing


def with_fft_signature(kind: int, run):
    """A rule with torch.fft's signature for ``kind`` (1-D, 2-D or n-D transforms) that calls ``run(x, size, dim, norm)``.

    Usage: ``rule = with_fft_signature(2, lambda x, s, dim, norm: ...)``
    """
    if kind == 1:
        def rule(input, n=None, dim=-1, norm=None):
            return run(input, n, dim, norm)
    elif kind == 2:
        def rule(input, s=None, dim=(-2, -1), norm=None):
            return run(input, s, dim, norm)
    else:
        def rule(input, s=None, dim=None, norm=None):
            return run(input, s, dim, norm)
    return rule


def _spectral_rule(name: str, kind: int):
    func = getattr(torch.fft, name)

    def run(x, size, dim, norm):
        if not isinstance(x, DomainTensor):
            raise NotImplementedError(f"torch.fft.{name} with a domain tensor as other than its input")
        size = global_sizes(size)
        spec = x.spec
        dims = transformed_dims(kind, x.ndim, dim, size)
        if spec.dim not in dims:  # NOTE: an empty shard too: the FFT libraries refuse empty inputs
            return Step(lambda t: on_maybe_empty(lambda u: func(u, size, dim, norm), t), (x,), out=spec)
        _check_free(f"torch.fft.{name}", x, dims)
        return _whole_along(x, dims, lambda t: func(t, size, dim, norm))

    rule = with_fft_signature(kind, run)
    rule.__name__ = f"fft_{name}"
    return rule


for _name, _kind in FFT_OPS.items():
    register(getattr(torch.fft, _name))(_spectral_rule(_name, _kind))


def _shift_rule(name: str):
    """``torch.fft.fftshift``/``ifftshift``: a roll of half the length along each dim in ``dim`` (default: all)."""
    func = getattr(torch.fft, name)

    def rule(input, dim=None):
        if not isinstance(input, DomainTensor):
            raise NotImplementedError(f"torch.fft.{name} with a domain tensor as other than its input")
        dims = list(range(input.ndim)) if dim is None else [d % input.ndim for d in ([dim] if isinstance(dim, int) else dim)]
        if input.spec.dim not in dims:
            return Step(lambda t: on_maybe_empty(lambda u: func(u, dim), t), (input,), out=input.spec)
        _check_free(f"torch.fft.{name}", input, dims)
        return _whole_along(input, dims, lambda t: func(t, dim))

    rule.__name__ = f"fft_{name}"
    return rule


for _name in ("fftshift", "ifftshift"):
    register(getattr(torch.fft, _name))(_shift_rule(_name))
