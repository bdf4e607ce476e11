"""Latitude-weighted loss and the standard forecast scores (RMSE, ACC), the same code on plain and domain tensors.

Fields are ``(..., lat, lon)``; ``weights`` is the global ``(H, 1)`` column of ``LatLonGrid.weights`` (mean 1).
On a domain tensor the weights are sliced to each rank's rows and the means/sums over (lat, lon) are global
reductions, so every rank gets the one-process value, whatever the layout (slabs, blocks, uneven, empty).

Usage::

    loss = weighted_mse(pred, target, grid.weights)          # a scalar: the training loss
    rmse(pred, target, grid.weights)                         # (B, C): per sample and channel (WeatherBench 2)
    acc(pred, target, grid.weights, climatology)             # (B, C): anomaly correlation
"""

from __future__ import annotations

import torch

__all__ = ["acc", "rmse", "weighted_mse"]


def _weights(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if weights.ndim != 2 or weights.shape[1] != 1 or weights.shape[0] != like.shape[-2]:
        raise ValueError(f"latitude weights must be (H, 1) with H = {like.shape[-2]} (the field's global latitudes), "
                         f"got {tuple(weights.shape)}; use LatLonGrid(lat, lon).weights")
    return weights.to(like.dtype)


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over every point of ``w(lat) * (pred - target)**2``: each point counts by its cell's area.

    Usage: ``loss = weighted_mse(model(x), y, grid.weights)``
    """
    return ((pred - target) ** 2 * _weights(weights, pred)).mean()


def rmse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE over (lat, lon), per leading index (e.g. ``(B, C)``).

    Usage: ``rmse(forecast, truth, grid.weights).mean(0)  # per channel``
    """
    return ((pred - target) ** 2 * _weights(weights, pred)).mean(dim=(-2, -1)).sqrt()


def acc(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
        climatology: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Latitude-weighted anomaly correlation over (lat, lon), per leading index (uncentered, as WeatherBench 2).

    Usage: ``acc(forecast, truth, grid.weights, clim)  # clim: (C, H, W) global, or 0 for normalized fields``
    """
    w = _weights(weights, pred)
    fa, oa = pred - climatology, target - climatology
    return (w * fa * oa).sum(dim=(-2, -1)) / ((w * fa ** 2).sum(dim=(-2, -1)) * (w * oa ** 2).sum(dim=(-2, -1))).sqrt()
