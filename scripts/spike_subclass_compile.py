"""Spike behind the domain tensor's mechanism (docs/domain.md, "The tensor type"): can a ``__torch_function__``
subclass whose storage is the shard but whose size queries answer for the whole tensor be compiled whole?

A minimal such subclass (``Global``: ``.shape``/``size()``/``numel()`` global, every other op run on the subclass
under ``DisableTorchFunctionSubclass`` and its result re-classed, as torch's own ``Tensor.__torch_function__``
does) against plain torch, on a conv + ReLU + a hand-written mean that reads ``numel()``: the result, the Dynamo
frame count with ``fullgraph=True`` (inductor), and the step time eager and compiled.

    python scripts/spike_subclass_compile.py            # prints one table

Two findings shaped mesh3d's dispatcher: Dynamo cannot trace ``t.as_subclass(torch.Tensor)`` on such a subclass
(a graph break: unwrap by running the op under ``DisableTorchFunctionSubclass`` instead), and it asks every input
``_is_view()`` and ``_base`` (they must pass through, never raise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend


@dataclass(frozen=True)
class Spec:
    dim: int
    global_length: int


_PASS = {torch.Tensor.dim, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
         torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor._is_view,  # type: ignore[attr-defined]
         torch.Tensor.is_contiguous, torch.Tensor.stride, torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
         torch.Tensor.is_floating_point, torch.Tensor.grad_fn.__get__, torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
         torch.Tensor.data_ptr, torch.Tensor._base.__get__}  # type: ignore[attr-defined]
_SIZE = {torch.Tensor.shape.__get__, torch.Tensor.size}  # type: ignore[attr-defined]


class Global(torch.Tensor):
    """Storage: the shard. Size queries: the whole tensor's."""

    _spec: Spec

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SIZE or func is torch.Tensor.numel:
            x = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                shape = list(x.shape)
            shape[x._spec.dim] = x._spec.global_length
            if func is torch.Tensor.numel:
                n = 1
                for s in shape:
                    n *= s
                return n
            if func is torch.Tensor.size and len(args) > 1:
                return shape[args[1]]
            return torch.Size(shape)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if func in _PASS:
                return out
            spec = next(a._spec for a in args if isinstance(a, Global))
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                out = out.as_subclass(Global)
                out._spec = spec
        return out


def _wrap(t: torch.Tensor, spec: Spec) -> Global:
    with torch._C.DisableTorchFunctionSubclass():
        g = t.as_subclass(Global)
    g._spec = spec
    return g


def step(x, w):
    y = F.conv2d(x, w, padding=1).relu()
    return (y * y).sum() / y.numel()


def _ms(fn, *args, n: int = 50) -> float:
    for _ in range(5):
        fn(*args)
    start = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 16, 48, 48), torch.randn(16, 16, 3, 3)
    g = _wrap(x.clone(), Spec(2, 48))
    counter = CompileCounterWithBackend("inductor")
    compiled_sub = torch.compile(step, backend=counter, fullgraph=True)
    compiled_plain = torch.compile(step, fullgraph=True)
    same = abs(float(compiled_sub(g, w)) - float(step(x, w))) <= 1e-5 * abs(float(step(x, w)))
    rows = [("plain eager", _ms(step, x, w)), ("plain compiled", _ms(compiled_plain, x, w)),
            ("subclass eager", _ms(step, g, w)), ("subclass compiled", _ms(compiled_sub, g, w))]
    print(f"fullgraph compile of the subclass: ok, {counter.frame_count} frame(s); equal to eager plain (rel 1e-5): {same}")
    base = rows[1][1]
    for name, ms in rows:
        print(f"{name:18s} {ms:7.3f} ms  ({ms / base:.2f}x compiled plain)")


if __name__ == "__main__":
    main()
