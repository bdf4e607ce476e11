"""A latitude x longitude grid that means the sphere: longitude periodic, latitude bounded at the poles.

On the domain axis the grid is split in (lat, lon) blocks (or lat slabs). ``sphere_pad`` pads longitude
circularly, so a convolution sees across the 0/360 seam even when longitude is split (the ranks at the two
ends of a grid line exchange their columns), and pads latitude without wrapping (``"replicate"`` or zeros).
Latitude weights come from the *global* coordinates, so a loss or metric built from them is the one-process
value on every layout (a plain ``(H, 1)`` tensor meeting a domain tensor is sliced to each rank's rows).

Usage::

    grid = LatLonGrid(lat, lon)                    # degrees, global (e.g. WeatherDataset.lat / .lon)
    grid.weights                                   # (H, 1) fp64 cell-area weights, mean 1
    y = SphereConv2d(8, 8, 3)(x)                   # x: (B, C, H, W), plain or a DomainTensor
    y = sphere_pad(x, (1, 2))                      # 1 row of lat (replicate), 2 columns of lon (circular)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LAT_MODES", "LatLonGrid", "SphereConv2d", "lat_weights", "sphere_pad"]

#: How latitude is padded at the poles (``F.pad`` modes that do not wrap).
LAT_MODES = ("replicate", "constant", "reflect")


def lat_weights(lat: Sequence[float] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Cell-area weights of latitudes in degrees (any order, poles allowed), normalized to mean 1: ``(H, 1)`` fp64.

    Usage: ``w = lat_weights(np.linspace(90, -90, 721))  # w[0] > 0 at the pole (a polar cap, not cos 90 = 0)``

    Each latitude owns the band between the midpoints to its neighbours (clipped to +-90); its weight is the
    band's area, ``sin(upper) - sin(lower)`` (WeatherBench 2's rule for grids that include the poles).
    """
    lat_d = np.array(lat.detach().cpu() if isinstance(lat, torch.Tensor) else lat, dtype=np.float64).reshape(-1)
    if lat_d.size < 2 or np.abs(lat_d).max() > 90 or len(np.unique(lat_d)) != lat_d.size:
        raise ValueError(f"lat_weights: need >= 2 distinct latitudes in degrees within [-90, 90], got {lat_d[:5]}...")
    order = np.argsort(lat_d)
    sorted_lat = np.radians(lat_d[order])
    edges = np.concatenate([[-np.pi / 2], (sorted_lat[1:] + sorted_lat[:-1]) / 2, [np.pi / 2]])
    area = np.sin(edges[1:]) - np.sin(edges[:-1])
    weights = np.empty_like(area)
    weights[order] = area
    return torch.from_numpy(weights / weights.mean()).reshape(-1, 1)


class LatLonGrid:
    """Global latitude and longitude coordinates (degrees): the weights, and a check that longitude closes the circle.

    Usage: ``grid = LatLonGrid(ds.lat, ds.lon); loss = weighted_mse(y, t, grid.weights)``
    """

    def __init__(self, lat: Any, lon: Any) -> None:
        self.lat = np.asarray(lat, dtype=np.float64).reshape(-1)
        self.lon = np.asarray(lon, dtype=np.float64).reshape(-1)
        step = np.diff(self.lon)
        if self.lon.size < 2 or not np.allclose(step, step[0]) or not np.isclose(step[0] * self.lon.size % 360, 0):
            raise ValueError(f"LatLonGrid: longitude must be evenly spaced around the whole circle (periodic), got "
                             f"{self.lon.size} points with spacing {step[:3]}...; a regional grid is not periodic")
        self.weights = lat_weights(self.lat)

    @property
    def shape(self) -> tuple[int, int]:
        return self.lat.size, self.lon.size


def sphere_pad(x: torch.Tensor, pad: tuple[int, int], lat_mode: str = "replicate", value: float = 0.0) -> torch.Tensor:
    """Pad the last two dims (lat, lon) of ``x``: ``pad[1]`` longitude columns circularly, ``pad[0]`` latitude rows by ``lat_mode``.

    Usage: ``sphere_pad(x, (1, 1))  # a 3x3 conv's padding on the sphere``
    """
    if lat_mode not in LAT_MODES:
        raise ValueError(f"sphere_pad: lat_mode={lat_mode!r} must be one of {LAT_MODES} (latitude does not wrap)")
    p_lat, p_lon = pad
    if p_lon:
        x = F.pad(x, (p_lon, p_lon, 0, 0), mode="circular")  # NOTE: across the 0/360 seam, also when lon is split
    if p_lat:
        x = F.pad(x, (0, 0, p_lat, p_lat), mode=lat_mode, **({"value": value} if lat_mode == "constant" else {}))
    return x


class SphereConv2d(nn.Conv2d):
    """``nn.Conv2d`` over (lat, lon) with "same" padding on the sphere: circular in longitude, ``lat_mode`` in latitude.

    Usage: ``SphereConv2d(4, 16, 3)``; ``SphereConv2d(4, 16, (3, 5), lat_mode="constant")``
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], *,
                 lat_mode: str = "replicate", **kwargs: Any) -> None:
        if kwargs.get("padding", 0) != 0 or kwargs.get("stride", 1) != 1:
            raise ValueError("SphereConv2d pads itself ('same' on the sphere) with stride 1; do not pass padding/stride")
        super().__init__(in_channels, out_channels, kernel_size, **kwargs)
        k_lat, k_lon = self.kernel_size
        d_lat, d_lon = self.dilation
        if k_lat % 2 == 0 or k_lon % 2 == 0:
            raise ValueError(f"SphereConv2d needs odd kernel sizes for 'same' padding, got {self.kernel_size}")
        if lat_mode not in LAT_MODES:
            raise ValueError(f"SphereConv2d: lat_mode={lat_mode!r} must be one of {LAT_MODES}")
        self.lat_mode = lat_mode
        self.sphere_padding = (d_lat * (k_lat - 1) // 2, d_lon * (k_lon - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(sphere_pad(x, self.sphere_padding, self.lat_mode))
