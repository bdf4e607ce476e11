"""Custom ops for the tests, as a library would ship them: ``torch.library.custom_op`` kernels with their own backward,
opaque to mesh3d (``m3test::``). Importing this module defines them once per process.

* ``stencil(x, w, stride, dilation, pad, periodic)``: a 1-D correlation along the last dim with zero or circular
  padding of ``pad`` rows (a finite-difference or DISCO-like kernel);
* ``smooth(x, w, stride, dilation, pad, periodic)``: a depthwise filter with taps ``w`` along the last dim of a tensor
  of any rank (a window op on blocks too);
* ``softclip(x, y)``: element-wise, two operands;
* ``mix(x, w)``: mixes channels (dim 1) only;
* ``spectral(x, keep)``: a low-pass filter along the last dim through the FFT (needs the whole dim);
* ``energy(x)``: the sum of squares along the last dim, kept as a length-1 dim (the whole dim, reduced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _stencil_math(x: torch.Tensor, w: torch.Tensor, stride: int, dilation: int, pad: int, periodic: bool) -> torch.Tensor:
    x = F.pad(x, (pad, pad), mode="circular" if periodic else "constant")
    return F.conv1d(x, w, stride=stride, dilation=dilation)


@torch.library.custom_op("m3test::stencil", mutates_args=())
def stencil(x: torch.Tensor, w: torch.Tensor, stride: int, dilation: int, pad: int, periodic: bool) -> torch.Tensor:
    return _stencil_math(x, w, stride, dilation, pad, periodic)


@stencil.register_fake
def _(x, w, stride, dilation, pad, periodic):
    n = (x.shape[-1] + 2 * pad - dilation * (w.shape[-1] - 1) - 1) // stride + 1
    return x.new_empty((x.shape[0], w.shape[0], n))


def _vjp_backward(math):
    """A backward that differentiates ``math`` (the kernel's own formula) again: the library's hand-written one."""
    def setup(ctx, inputs, output):
        ctx.inputs = inputs

    def backward(ctx, grad):
        tensors = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in ctx.inputs]
        with torch.enable_grad():
            out = math(*tensors)
        wanted = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True)) if wanted else iter(())
        return tuple(next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in tensors)
    return setup, backward


_setup, _backward = _vjp_backward(_stencil_math)
stencil.register_autograd(_backward, setup_context=_setup)


def _smooth_math(x: torch.Tensor, w: torch.Tensor, stride: int, dilation: int, pad: int, periodic: bool) -> torch.Tensor:
    if pad:
        x = torch.cat([x[..., -pad:], x, x[..., :pad]], -1) if periodic else \
            torch.cat([x.new_zeros((*x.shape[:-1], pad)), x, x.new_zeros((*x.shape[:-1], pad))], -1)
    n = (x.shape[-1] - dilation * (w.shape[0] - 1) - 1) // stride + 1
    return sum(w[t] * x[..., t * dilation: t * dilation + (n - 1) * stride + 1: stride] for t in range(w.shape[0]))


@torch.library.custom_op("m3test::smooth", mutates_args=())
def smooth(x: torch.Tensor, w: torch.Tensor, stride: int, dilation: int, pad: int, periodic: bool) -> torch.Tensor:
    return _smooth_math(x, w, stride, dilation, pad, periodic)


@smooth.register_fake
def _(x, w, stride, dilation, pad, periodic):
    n = (x.shape[-1] + 2 * pad - dilation * (w.shape[0] - 1) - 1) // stride + 1
    return x.new_empty((*x.shape[:-1], n))


_setup, _backward = _vjp_backward(_smooth_math)
smooth.register_autograd(_backward, setup_context=_setup)


def _softclip_math(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * y + x


@torch.library.custom_op("m3test::softclip", mutates_args=())
def softclip(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _softclip_math(x, y)


softclip.register_fake(lambda x, y: torch.empty_like(x + y))
_setup, _backward = _vjp_backward(_softclip_math)
softclip.register_autograd(_backward, setup_context=_setup)


def _mix_math(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bc...,dc->bd...", x, w)


@torch.library.custom_op("m3test::mix", mutates_args=())
def mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _mix_math(x, w)


mix.register_fake(lambda x, w: x.new_empty((x.shape[0], w.shape[0], *x.shape[2:])))
_setup, _backward = _vjp_backward(_mix_math)
mix.register_autograd(_backward, setup_context=_setup)


def _spectral_math(x: torch.Tensor, keep: int) -> torch.Tensor:
    f = torch.fft.rfft(x, dim=-1)
    f = torch.cat([f[..., :keep], torch.zeros_like(f[..., keep:])], dim=-1)
    return torch.fft.irfft(f, n=x.shape[-1], dim=-1)


@torch.library.custom_op("m3test::spectral", mutates_args=())
def spectral(x: torch.Tensor, keep: int) -> torch.Tensor:
    return _spectral_math(x, keep)


spectral.register_fake(lambda x, keep: torch.empty_like(x))
_setup, _backward = _vjp_backward(_spectral_math)
spectral.register_autograd(_backward, setup_context=_setup)


def _energy_math(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1, keepdim=True)


@torch.library.custom_op("m3test::energy", mutates_args=())
def energy(x: torch.Tensor) -> torch.Tensor:
    return _energy_math(x)


energy.register_fake(lambda x: x.new_empty((*x.shape[:-1], 1)))
_setup, _backward = _vjp_backward(_energy_math)
energy.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("m3test::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    """Fails on data it cannot take (any value above 100), as a library kernel's own check would."""
    if x.numel() and float(x.max()) > 100:
        raise RuntimeError("m3test::fragile: values above 100 are not supported")
    return x.clone()


fragile.register_fake(lambda x: torch.empty_like(x))


class CubeFunction(torch.autograd.Function):
    """An element-wise op written as an autograd.Function with a hand-written backward (a library's older style)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.detach() ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x


def register_rules() -> None:
    """The ops' domain rules, as a user writes them (docs/domain.md, 'Custom ops'); rules registered inside a
    rank-pool body are dropped after it."""
    from mesh3d import domain

    domain.register(torch.ops.m3test.stencil, domain.window(
        dim=-1, kernel=lambda x, w, *a: w.shape[-1], stride=lambda x, w, stride, *a: stride,
        dilation=lambda x, w, stride, dilation, *a: dilation, padding=lambda x, w, stride, dilation, pad, periodic: pad,
        periodic=lambda x, w, stride, dilation, pad, periodic: periodic))
    domain.register(torch.ops.m3test.smooth, domain.window(
        dim=-1, kernel=lambda x, w, *a: w.shape[0], stride=lambda x, w, stride, *a: stride,
        dilation=lambda x, w, stride, dilation, *a: dilation, padding=lambda x, w, stride, dilation, pad, periodic: pad,
        periodic=lambda x, w, stride, dilation, pad, periodic: periodic))
    domain.register(torch.ops.m3test.softclip, domain.elementwise())
    domain.register(torch.ops.m3test.mix, domain.local(dims=(1,)))
    domain.register(torch.ops.m3test.spectral, domain.whole_dim(dims=(-1,)))
    domain.register(energy, domain.whole_dim(dims=(-1,)))  # a custom_op function works as its operator
    domain.register(fragile, domain.elementwise())
    domain.register(CubeFunction, domain.elementwise())
