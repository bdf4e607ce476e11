"""CF names of the fields weather models forecast: ``standard_name`` and ``long_name`` by variable name and units.

A forecast store gives each field the CF standard name where the CF table has one (so CF tools, WeatherBench 2-style
scoring code and earth2studio's readers know what it is), and a long name always. Variables are known by their
short names as ERA5, WeatherBench 2 and earth2studio spell them (``z``, ``t``, ``t2m``, ``2t``, ``u10``, ``10u``,
``msl``, ...) or by WeatherBench 2's long names (``geopotential``, ``2m_temperature``). ``z`` in metres is a
geopotential height, in m2 s-2 a geopotential.

Usage: ``cf_attrs("t2m", "K") == {"standard_name": "air_temperature", "long_name": "2 metre temperature"}``
"""

from __future__ import annotations

__all__ = ["cf_attrs"]

# (standard_name, long_name) by variable name; None: no CF standard name.
_NAMES: dict[str, tuple[str | None, str]] = {
    "t": ("air_temperature", "temperature"),
    "u": ("eastward_wind", "eastward wind"),
    "v": ("northward_wind", "northward wind"),
    "w": ("lagrangian_tendency_of_air_pressure", "vertical velocity"),
    "q": ("specific_humidity", "specific humidity"),
    "r": ("relative_humidity", "relative humidity"),
    "t2m": ("air_temperature", "2 metre temperature"),
    "d2m": ("dew_point_temperature", "2 metre dewpoint temperature"),
    "u10": ("eastward_wind", "10 metre eastward wind"),
    "v10": ("northward_wind", "10 metre northward wind"),
    "u100": ("eastward_wind", "100 metre eastward wind"),
    "v100": ("northward_wind", "100 metre northward wind"),
    "msl": ("air_pressure_at_mean_sea_level", "mean sea level pressure"),
    "sp": ("surface_air_pressure", "surface pressure"),
    "tp": ("precipitation_amount", "total precipitation"),
    "tcwv": ("atmosphere_mass_content_of_water_vapor", "total column water vapour"),
    "sst": ("sea_surface_temperature", "sea surface temperature"),
    "skt": ("surface_temperature", "skin temperature"),
    "lsm": ("land_binary_mask", "land-sea mask"),
    "orog": ("surface_altitude", "orography"),
}
_ALIASES = {"2t": "t2m", "2d": "d2m", "10u": "u10", "10v": "v10", "u10m": "u10", "v10m": "v10", "100u": "u100",
            "100v": "v100", "temperature": "t", "u_component_of_wind": "u", "v_component_of_wind": "v",
            "vertical_velocity": "w", "specific_humidity": "q", "relative_humidity": "r", "2m_temperature": "t2m",
            "2m_dewpoint_temperature": "d2m", "10m_u_component_of_wind": "u10", "10m_v_component_of_wind": "v10",
            "mean_sea_level_pressure": "msl", "surface_pressure": "sp", "total_precipitation": "tp",
            "total_column_water_vapour": "tcwv", "sea_surface_temperature": "sst"}
_GEOPOTENTIAL = ("z", "gh", "geopotential", "geopotential_height")


def cf_attrs(variable: str, units: str) -> dict[str, str]:
    """``standard_name`` (where the CF table has one) and ``long_name`` of ``variable`` given in ``units``."""
    key = variable.lower()
    if key in _GEOPOTENTIAL:
        height = key in ("gh", "geopotential_height") or units.strip() in ("m", "gpm", "metre", "meter", "metres")
        return ({"standard_name": "geopotential_height", "long_name": "geopotential height"} if height else
                {"standard_name": "geopotential", "long_name": "geopotential"})
    standard, long_name = _NAMES.get(_ALIASES.get(key, key), (None, variable))
    return {"long_name": long_name} if standard is None else {"standard_name": standard, "long_name": long_name}
