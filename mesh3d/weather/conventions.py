"""How a forecast store names its dimensions and fields, so that the tool that reads it needs no renames.

Three conventions, chosen when the store is created (``forecast_ensemble(..., convention=)``, ``mesh3d forecast
--convention``) and recorded in it (the attribute ``mesh3d_convention``); mesh3d reads and scores each alike:

=================  ==============================================================================================
``cf`` (default)   ``z(init_time, lead_time, member, level, latitude, longitude)``, ``t2m(init_time, lead_time,
                   member, latitude, longitude)``: CF names (``forecast_reference_time``, ``forecast_period``,
                   ``realization``), one variable per field, pressure levels as a ``level`` dimension.
``weatherbench2``  as ``cf``, with WeatherBench 2's forecast dims: ``time`` (the init time),
                   ``prediction_timedelta``, ``realization`` (its ensemble dim). Its evaluation opens the store as a
                   forecast ``by_init`` (its ``schema.apply_time_conventions``); name the fields as its truth does
                   (``geopotential``, ``2m_temperature``: a dataset in ARCO ERA5 names gives those).
``earth2studio``   one variable per channel (``z500``, ``t2m``: levels in the names, no ``level`` dim) over
                   ``(time, lead_time, ensemble, lat, lon)``, as earth2studio's own inference outputs, which its
                   ``InferenceOutputSource`` reads as a data source.
=================  ==============================================================================================

Usage::

    conv = store_convention("weatherbench2")      # raises ValueError naming the choices
    conv.dims(leveled=True)                       # ('time', 'prediction_timedelta', 'realization', 'level', ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CONVENTIONS", "CONVENTION_ATTR", "COORD_NAMES", "StoreConvention", "convention_of", "store_convention"]

#: The store's attribute naming its convention (absent: ``cf``, as every store before conventions).
CONVENTION_ATTR = "mesh3d_convention"


@dataclass(frozen=True)
class StoreConvention:
    """The names a store gives its dims, and whether its variables are fields or channels.

    Usage: ``CONVENTIONS["earth2studio"].member  # 'ensemble'``
    """

    name: str
    init: str
    lead: str
    member: str
    latitude: str
    longitude: str
    #: one variable per channel, its level in its name (``z500``), instead of one per field with a ``level`` dim
    per_channel: bool = False
    level: str = "level"

    def dims(self, leveled: bool) -> tuple[str, ...]:
        """A variable's dims, in the store's order."""
        return (self.init, self.lead, self.member, *((self.level,) if leveled else ()), self.latitude, self.longitude)

    @property
    def coords(self) -> tuple[str, ...]:
        return (self.init, self.lead, "valid_time", self.member, self.level, self.latitude, self.longitude)


CONVENTIONS: dict[str, StoreConvention] = {
    "cf": StoreConvention("cf", "init_time", "lead_time", "member", "latitude", "longitude"),
    "weatherbench2": StoreConvention("weatherbench2", "time", "prediction_timedelta", "realization", "latitude",
                                     "longitude"),
    "earth2studio": StoreConvention("earth2studio", "time", "lead_time", "ensemble", "lat", "lon", per_channel=True),
}

#: Names no field may take, in any convention: the stores' coordinates and the restart group.
COORD_NAMES = tuple(sorted({n for c in CONVENTIONS.values() for n in c.coords} | {"restart"}))


def store_convention(name: str) -> StoreConvention:
    """The convention called ``name``; ``ValueError`` naming the choices for any other."""
    if name not in CONVENTIONS:
        raise ValueError(f"forecast store: convention {name!r} is not one of {', '.join(CONVENTIONS)} (cf: mesh3d's CF "
                         "names; weatherbench2: time/prediction_timedelta/realization; earth2studio: a variable per "
                         "channel over time/lead_time/ensemble/lat/lon)")
    return CONVENTIONS[name]


def convention_of(attrs: Any) -> StoreConvention:
    """The convention a store's attributes record (``cf`` where none is recorded)."""
    return store_convention(str(attrs.get(CONVENTION_ATTR, "cf")))
