"""The layout sweep's calls of torch-harmonics' kernels (``layout_cases.RECIPES``): each through the module that
calls it, built once per grid, on the sweep's (2, 3, N, W) value: latitudes along dim 2, longitudes along dim 3.

Usage: ``RECIPES.update(sphere_recipes())`` (empty where torch-harmonics' compiled kernels are absent)
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def _module(kind: str, nlat: int, nlon: int) -> torch.nn.Module:
    import torch_harmonics as th

    torch.manual_seed(0)
    grid = (nlat, nlon)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cutoff it chose
        made = {"conv": lambda: th.DiscreteContinuousConvS2(3, 2, grid, grid, kernel_shape=3),
                "save_x": lambda: th.DiscreteContinuousConvS2(3, 1, grid, grid, kernel_shape=3),
                "fused": lambda: th.DiscreteContinuousConvS2(3, 2, grid, grid, kernel_shape=3, fused=True),
                "transpose": lambda: th.DiscreteContinuousConvTransposeS2(3, 2, grid, grid, kernel_shape=3),
                "attention": lambda: th.NeighborhoodAttentionS2(3, grid, grid, num_heads=1)}[kind]()
    return made if kind == "attention" else made.double()  # NOTE: the attention kernels compute in float32


def _through(kind: str) -> Callable[[Any, Any], Any]:
    def call(x: Any, y: Any) -> Any:
        if x.ndim != 4:
            raise TypeError("a (B, C, lat, lon) field")  # the sweep skips calls one process cannot make
        module = _module(kind, x.shape[2], x.shape[3])
        return module(x.float()) if kind == "attention" else module(x)

    return call


def sphere_recipes() -> dict[Callable, list[Callable[[Any, Any], Any]]]:
    """The kernels mesh3d ships rules for, each with the calls that reach it (none without the library)."""
    if importlib.util.find_spec("torch_harmonics") is None:
        return {}
    from torch_harmonics.disco.optimized.disco_optimized import _DiscoSaveXConvFn

    disco, attention = torch.ops.disco_kernels, torch.ops.attention_kernels
    if not hasattr(disco, "_disco_s2_contraction_optimized"):
        return {}
    return {disco._disco_s2_contraction_optimized.default: [_through("conv")],
            _DiscoSaveXConvFn.apply: [_through("save_x")],
            disco._disco_s2_fused_conv_optimized.default: [_through("fused")],
            disco._disco_s2_transpose_contraction_optimized.default: [_through("transpose")],
            attention._neighborhood_s2_attention_optimized.default: [_through("attention")],
            attention.permute_to_nhwc.default: [lambda x, y: attention.permute_to_nhwc(x)],
            attention.permute_to_nchw.default: [lambda x, y: attention.permute_to_nchw(x)]}
