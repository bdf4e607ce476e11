"""Named latitude/longitude boxes that forecast scores are averaged over (WeatherBench 2's regions and the user's own).

A region is a box: latitudes from ``south`` to ``north`` and longitudes from ``west`` eastwards to ``east``, both ends
included, in degrees; a box may cross the 0/360 (or -180/180) meridian (``west`` > ``east``: Europe is -12.5 to 42.5,
written ``347.5:42.5`` or ``-12.5:42.5``), and grids in 0..360 or -180..180 both work. Scores over a region are the
latitude-weighted means over the grid points inside it (the weights of the whole grid, restricted to the box).

Usage::

    regions = parse_regions(["global", "tropics", "alps=44:49,5:17"])
    mask = regions[2].mask(lat, lon)              # (H, W) bool: the grid points inside the box
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["REGIONS", "Region", "parse_regions"]


@dataclass(frozen=True)
class Region:
    """A named latitude/longitude box in degrees; ``west`` > ``east`` crosses the meridian at 0/360.

    Usage: ``Region("europe", 35, 75, -12.5, 42.5).mask(lat, lon)``
    """

    name: str
    south: float = -90.0
    north: float = 90.0
    west: float = 0.0
    east: float = 360.0

    def __post_init__(self) -> None:
        if not (-90 <= self.south <= self.north <= 90):
            raise ValueError(f"region {self.name!r}: latitudes must satisfy -90 <= south <= north <= 90, got south "
                             f"{self.south}, north {self.north}")
        if not all(np.isfinite([self.west, self.east])):
            raise ValueError(f"region {self.name!r}: longitudes must be finite degrees, got {self.west}, {self.east}")

    @property
    def is_global(self) -> bool:
        return self.south <= -90 and self.north >= 90 and self.east - self.west >= 360

    def mask(self, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        """``(H, W)`` bool: the grid points inside the box (``lat`` (H,), ``lon`` (W,) in degrees)."""
        lat, lon = np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64)
        rows = (lat >= self.south) & (lat <= self.north)
        if self.east - self.west >= 360:
            cols = np.ones(lon.shape, dtype=bool)
        else:  # eastward distance from the west edge, within the box's width
            cols = np.mod(lon - self.west, 360.0) <= np.mod(self.east - self.west, 360.0)
        return rows[:, None] & cols[None, :]

    def describe(self) -> str:
        return f"{self.name} ({self.south:g}..{self.north:g} N, {self.west:g}..{self.east:g} E)"


#: WeatherBench 2's named regions (its ``regions.py``: the extra-tropics from 20 degrees, Europe and North America as
#: its boxes), plus the poles' caps.
REGIONS: dict[str, Region] = {r.name: r for r in (
    Region("global"),
    Region("tropics", -20, 20),
    Region("extratropics_north", 20, 90),
    Region("extratropics_south", -90, -20),
    Region("arctic", 60, 90),
    Region("antarctic", -90, -60),
    Region("europe", 35, 75, -12.5, 42.5),
    Region("north_america", 25, 60, -120, -75),
)}


def _parse(item: str) -> Region:
    name, sep, box = item.partition("=")
    name = name.strip()
    if not sep:
        if name not in REGIONS:
            raise ValueError(f"unknown region {name!r}: choose from {', '.join(REGIONS)} or give a box as "
                             "NAME=SOUTH:NORTH,WEST:EAST (degrees, e.g. alps=44:49,5:17)")
        return REGIONS[name]
    try:
        lats, lons = box.split(",")
        south, north = (float(v) for v in lats.split(":"))
        west, east = (float(v) for v in lons.split(":"))
    except ValueError:
        raise ValueError(f"region {item!r}: give a box as NAME=SOUTH:NORTH,WEST:EAST in degrees (e.g. "
                         "alps=44:49,5:17; west > east crosses the 0/360 meridian)") from None
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"region {item!r}: the name must be letters, digits, '_' or '-'")
    return Region(name, south, north, west, east)


def parse_regions(items: Sequence[str | Region] | None) -> list[Region]:
    """Regions by name (``REGIONS``), as ``NAME=SOUTH:NORTH,WEST:EAST`` boxes, or ``Region`` objects; default global.

    Usage: ``parse_regions(["global", "europe", "alps=44:49,5:17"])``
    """
    regions = [item if isinstance(item, Region) else _parse(item) for item in (items or ["global"])]
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise ValueError(f"regions: each name once, got {names}")
    return regions
