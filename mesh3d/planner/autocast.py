"""``torch.autocast`` regions planned as they run on the device, though the simulation runs on meta tensors.

Autocast acts at dispatch only on tensors of its device, so on meta tensors a model's
``with torch.autocast("cuda", dtype=torch.bfloat16):`` changes nothing (and on a machine without CUDA the
region disables itself). ``AutocastEmulation`` gives the plan what the device would run:

* while it is active, ``torch.autocast`` regions of the plan's device type stay enabled as the user wrote
  them (their thread-local state is set as on the device, so activation checkpointing re-enters them when it
  recomputes);
* inside an enabled region, a function mode applies autocast's op lists (``torch.amp`` documentation, torch
  2.13): the lower-precision ops (matmuls, ``linear``, convolutions, attention) cast their floating inputs
  to the region's dtype, the float32 ops cast them to float32, the ``fp32_set_opt_dtype`` ops (CUDA:
  ``softmax``, ``log_softmax``, ``sum``, ``prod``, ``cumsum``, ``cumprod``) compute in float32 without a copy, the
  promote ops cast to the widest input type; float64 is never cast; every other op runs in its inputs'
  dtype. Casts of leaf parameters are cached for the outermost region, as autocast's weight cache does.

Usage::

    emulation = AutocastEmulation("cuda")
    with emulation.patched(), emulation.casts():   # the casts mode with the simulation's other modes
        loss = model(x_on_meta).sum()              # the model's own autocast regions now cast as on the GPU
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mesh3d._torch_private import tree_map

__all__ = ["AutocastEmulation"]

_T = torch.Tensor


def _functions(*names: str) -> set[Any]:
    """The torch, ``torch.nn.functional`` and Tensor functions of these names that exist in this torch."""
    found = set()
    for name in names:
        for owner in (torch, F, _T):
            fn = getattr(owner, name, None)
            if callable(fn):
                found.add(fn)
    return found


_LOWER_COMMON = _functions("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                           "convolution", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "prelu",
                           "scaled_dot_product_attention", "__matmul__", "__rmatmul__")
_LOWER = {"cuda": _LOWER_COMMON | _functions("mv", "addmv", "addr", "einsum", "chain_matmul"), "cpu": _LOWER_COMMON}
_LOSSES = ("nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "cross_entropy",
           "binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss", "poisson_nll_loss",
           "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
           "multi_margin_loss")
_FP32 = {
    "cuda": _functions(*_LOSSES, "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
                       "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm",
                       "group_norm", "norm", "normalize", "cosine_similarity", "dist", "pdist", "cdist", "renorm",
                       "logsumexp"),
    "cpu": _functions(*_LOSSES, "binary_cross_entropy", "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "cdist",
                      "grid_sample", "prod", "quantile", "nanquantile", "trace"),
}
_FP32_OUTPUT = {"cuda": _functions("softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod"), "cpu": set()}
_PROMOTE = _functions("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                      "scatter_add", "tensordot")


def _castable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


class AutocastEmulation:
    """Autocast regions of ``device`` ("cuda" or "cpu") applied to meta tensors (see the module docstring): one per
    simulation; ``patched()`` around the step, a fresh ``casts()`` mode wherever the simulation's modes are entered,
    ``region()`` to recompute a checkpointed module under the autocast state its forward ran in."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._depth = 0
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Regions of the plan's device stay enabled as written (the public ``torch.autocast`` class is patched for
        the step and restored after it)."""
        cls = torch.amp.autocast_mode.autocast
        originals = {name: cls.__dict__[name] for name in ("__init__", "__enter__", "__exit__")}
        init, enter, leave = originals["__init__"], originals["__enter__"], originals["__exit__"]
        emulation = self

        def __init__(region, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                     cache_enabled: bool | None = None) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast": not for a plan
                init(region, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            region.mesh3d_planned = enabled if device_type == emulation.device else None

        def __enter__(region):
            out = enter(region)
            if getattr(region, "mesh3d_planned", None) is not None:
                torch.set_autocast_enabled(emulation.device, region.mesh3d_planned)
                emulation._depth += 1
            return out

        def __exit__(region, *exc: Any):
            if getattr(region, "mesh3d_planned", None) is not None:
                emulation._leave()
            return leave(region, *exc)

        cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(cls, name, fn)
            self._cache.clear()
            self._depth = 0

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:  # autocast drops its weight cache when the outermost region ends
            self._cache.clear()

    def region(self) -> contextlib.AbstractContextManager[None]:
        """The autocast state in force now, to re-enter later (a checkpointed module's recomputation).

        NOTE: checkpointing re-enters autocast only for its inputs' device type, which is "meta" here."""
        enabled, dtype = torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device)

        @contextlib.contextmanager
        def again() -> Iterator[None]:
            before = torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device)
            torch.set_autocast_enabled(self.device, enabled)
            torch.set_autocast_dtype(self.device, dtype)
            self._depth += 1
            try:
                yield
            finally:
                self._leave()
                torch.set_autocast_enabled(self.device, before[0])
                torch.set_autocast_dtype(self.device, before[1])

        return again()

    def casts(self) -> TorchFunctionMode:
        """A function mode that casts as autocast does in the region in force."""
        return _Casts(self)

    def to(self, x: Any, dtype: torch.dtype, cache: bool) -> Any:
        """``x`` cast to ``dtype`` if autocast would (floating, not float64), from the weight cache for parameters."""
        if not _castable(x) or x.dtype == dtype:
            return x
        if not (cache and x.dtype == torch.float32 and x.is_leaf and x.requires_grad):
            return x.to(dtype)
        hit = self._cache.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
        cast = x.to(dtype)
        self._cache[id(x)] = (weakref.ref(x), cast)
        return cast


class _Casts(TorchFunctionMode):
    def __init__(self, emulation: AutocastEmulation) -> None:
        super().__init__()
        self.emulation = emulation

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        em = self.emulation
        device = em.device
        if not torch.is_autocast_enabled(device):
            return func(*args, **kwargs)
        if func in _LOWER[device]:
            low = torch.get_autocast_dtype(device)
            cache = torch.is_autocast_cache_enabled()
            cast = lambda x: em.to(x, low, cache)  # noqa: E731
        elif func in _FP32[device]:
            cast = lambda x: em.to(x, torch.float32, False)  # noqa: E731
        elif func in _FP32_OUTPUT[device]:
            if kwargs.get("dtype") is None and args and _castable(args[0]):
                kwargs = dict(kwargs, dtype=torch.float32)
            return func(*args, **kwargs)
        elif func in _PROMOTE:
            floats = [x.dtype for x in (*args, *kwargs.values()) if _castable(x)]
            if not floats:
                return func(*args, **kwargs)
            widest = torch.float32 if len(set(floats)) > 1 else floats[0]
            cast = lambda x: em.to(x, widest, False)  # noqa: E731
        else:
            return func(*args, **kwargs)
        return func(*tree_map(cast, args), **tree_map(cast, kwargs))
