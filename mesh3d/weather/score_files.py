"""The files a scoring writes: a CF dataset of every score (``scores.nc``), the rows as CSV and JSON, a summary table
as text, and the score figure.

``scores.nc`` follows WeatherBench 2's results layout: one variable per field (``z500``, ``t2m``, ...) with the
field's ``units``, over ``(metric, region, lead_time)``; a metric's ``metric_units`` coordinate says whether it is in
the field's units (``rmse``, ``crps``, ``spread``) or dimensionless (``"1"``: ``spread_skill``, ``acc``). The
per-member scores are ``<field>_member`` over ``(member_metric, region, lead_time, member)``. ``lead_time`` is a CF
time period (``standard_name: forecast_period``), ``inits`` counts the init times scored at each lead, and each
region's box is on the ``region`` coordinate (``region_south`` ... ``region_east``).

Usage::

    tables = score_regions("fc.zarr", regions=["global", "europe"])
    paths = write_score_files(tables, "scores/")      # scores.nc, scores.csv, scores_members.csv, scores.json, ...
    xr.open_dataset("scores/scores.nc")["z500"].sel(metric="rmse", region="europe")
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mesh3d.weather.figures import score_figure
from mesh3d.weather.regions import REGIONS, Region
from mesh3d.weather.scores import MEMBER_SCORES, SCORES, ScoreTable, write_csv

__all__ = ["scores_dataset", "summary_text", "write_score_files"]

#: Ensemble scores in the field's own units; the others are dimensionless.
_IN_FIELD_UNITS = ("rmse", "crps", "spread")


Tables = Mapping[str, ScoreTable] | Sequence[ScoreTable] | ScoreTable


def _tables(tables: Tables) -> list[ScoreTable]:
    if isinstance(tables, ScoreTable):
        return [tables]
    out = list(tables.values()) if isinstance(tables, Mapping) else list(tables)
    if not out:
        raise ValueError("write_score_files: no score table given")
    return out


def scores_dataset(tables: Tables,
                   regions: Mapping[str, Region] | None = None) -> Any:
    """The tables as one ``xarray.Dataset`` (the layout in this module's docstring); ``regions`` gives the boxes of
    regions not in ``REGIONS``.

    Usage: ``scores_dataset(score_regions("fc.zarr", regions=["global", "tropics"])).to_netcdf("scores.nc")``
    """
    import xarray as xr  # noqa: PLC0415 (optional: the weather extra)

    tabs = _tables(tables)
    first = tabs[0]
    metrics = [m for m in first.metrics if m in SCORES]
    members = [m for m in first.metrics if m in MEMBER_SCORES and first.member_rmse is not None]
    boxes = [(regions or {}).get(t.region) or REGIONS.get(t.region) or Region(t.region) for t in tabs]
    lead = np.array([np.timedelta64(int(round(h * 3600)), "s") for h in first.lead_hours], dtype="timedelta64[ns]")
    data: dict[str, Any] = {}
    for c, name in enumerate(first.channels):
        units = first.units[c] or "1"
        if metrics:
            values = np.stack([np.stack([getattr(t, m)[:, c] for t in tabs]) for m in metrics])
            data[name] = (("metric", "region", "lead_time"), values,
                          {"units": units, "long_name": f"{name}: ensemble scores (metric_units: the field's units or 1)"})
        if members:
            values = np.stack([np.stack([getattr(t, m)[:, :, c] for t in tabs]) for m in members])
            data[f"{name}_member"] = (("member_metric", "region", "lead_time", "member"), values,
                                      {"units": units, "long_name": f"{name}: each member's scores"})
    coords = {
        "metric": ("metric", np.array(metrics, dtype=object), {"long_name": "ensemble score"}),
        "metric_units": ("metric", np.array(["field" if m in _IN_FIELD_UNITS else "1" for m in metrics], dtype=object),
                         {"long_name": "units of the metric: 'field' for the field's units, '1' dimensionless"}),
        "region": ("region", np.array([t.region for t in tabs], dtype=object), {"long_name": "region scored over"}),
        "lead_time": ("lead_time", lead, {"standard_name": "forecast_period", "long_name": "lead time"}),
        "inits": ("lead_time", np.asarray(first.inits, dtype=np.int64),
                  {"long_name": "init times scored at this lead"}),
    }
    for side, unit in (("south", "degrees_north"), ("north", "degrees_north"), ("west", "degrees_east"),
                       ("east", "degrees_east")):
        coords[f"region_{side}"] = ("region", np.array([getattr(b, side) for b in boxes], dtype=np.float64),
                                    {"units": unit, "long_name": f"the region's {side} edge"})
    if members:
        coords["member_metric"] = ("member_metric", np.array(members, dtype=object), {"long_name": "member score"})
        coords["member"] = ("member", np.arange(first.members), {"standard_name": "realization"})
    return xr.Dataset(data, coords=coords, attrs={
        "Conventions": "CF-1.8", "title": "forecast scores (mesh3d score)", "ensemble_members": first.members,
        "references": "RMSE and ACC of the ensemble mean, fair CRPS, spread: mesh3d/weather/scores.py"})


def summary_text(tables: Tables,
                 regions: Mapping[str, Region] | None = None) -> str:
    """Each region's ``ScoreTable.format()`` under a heading naming its box."""
    parts = []
    for t in _tables(tables):
        box = (regions or {}).get(t.region) or REGIONS.get(t.region)
        parts.append(f"region {box.describe() if box else t.region}, {t.members} members\n{t.format()}")
    return "\n\n".join(parts)


def write_score_files(tables: Tables, directory: str | os.PathLike, title: str = "",
                      regions: Mapping[str, Region] | None = None) -> list[str]:
    """``scores.nc``, ``scores.csv`` (and ``scores_members.csv`` with member scores), ``scores.json``, ``scores.txt``
    and ``scores.png`` (the first region's figure) in ``directory``; returns their paths. One rank calls it.

    Usage: ``write_score_files(score_regions("fc.zarr", regions=["global", "europe"]), "scores/")``
    """
    tabs = _tables(tables)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    paths = []

    def path(name: str) -> str:
        paths.append(os.path.join(directory, name))
        return paths[-1]

    rows = [row for t in tabs for row in t.rows()]
    member_rows = [row for t in tabs for row in t.member_rows()]
    write_csv(path("scores.csv"), rows)
    if member_rows:
        write_csv(path("scores_members.csv"), member_rows)
    with open(path("scores.json"), "w") as f:
        json.dump({"members": tabs[0].members, "regions": [t.region for t in tabs], "scores": rows,
                   "member_scores": member_rows}, f, indent=1)
    with open(path("scores.txt"), "w") as f:
        f.write(summary_text(tabs, regions) + "\n")
    tmp = os.path.join(directory, ".scores.nc.tmp")
    scores_dataset(tabs, regions).to_netcdf(tmp, engine="h5netcdf")
    os.replace(tmp, path("scores.nc"))  # NOTE: whole or absent: a reader never meets half a file
    if any(m in SCORES for m in tabs[0].metrics):
        score_figure(tabs[0], title).savefig(path("scores.png"), dpi=90)
    return paths
