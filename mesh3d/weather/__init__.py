"""Weather and climate on the mesh: a lat x lon grid that means the sphere, latitude-weighted loss and metrics,
autoregressive rollout and forecasts written block by block.

Usage::

    from mesh3d.weather import LatLonGrid, SphereConv2d, weighted_mse, rmse, acc, rollout_loss, forecast, ForecastWriter
    grid = LatLonGrid(ds.lat, ds.lon)                   # global coordinates (a WeatherDataset has them)
    conv = SphereConv2d(c, c, 3)                        # longitude periodic (across the seam), latitude not
    loss = rollout_loss(model, x, ys, lambda p, t: weighted_mse(p, t, grid.weights))   # fed back, checkpointed
    forecast(model, x, 8, ForecastWriter("fc.zarr", num_samples, 8, like=x), sample_ids=ids)  # each rank its block
    forecast_ensemble(model, "era5.zarr", variables, "ens.zarr", init_times=[40], leads=10, members=8, stats=stats)
    run_forecast("pkg.mod:make", "ckpt", "era5.zarr", "ens.zarr", init_times=[40], leads=10, scores="scores/")
    score_forecast("ens.zarr").format()                 # RMSE, fair CRPS, spread/skill, ACC per channel and lead
    score_forecast("ens.zarr", climatology=open_climatology("clim.nc"))   # ACC against a climatology per channel
    write_score_files(score_regions("ens.zarr", regions=["global", "europe"]), "scores/")   # scores.nc, .csv, ...

See docs/weather.md.
"""

import importlib
from typing import Any

from mesh3d.weather.campaign import ForecastProgress, ForecastResult, forecast_ensemble
from mesh3d.weather.climatology import open_climatology
from mesh3d.weather.ensemble import MemberKey, MemberNoise, perturb_initial
from mesh3d.weather.fields import channels_array
from mesh3d.weather.inputs import weather_extra
from mesh3d.weather.grid import LatLonGrid, SphereConv2d, lat_weights, sphere_pad
from mesh3d.weather.metrics import acc, rmse, weighted_mse
from mesh3d.weather.rollout import forecast, rollout, rollout_loss
from mesh3d.weather.regions import REGIONS, Region
from mesh3d.weather.score_files import scores_dataset, write_score_files
from mesh3d.weather.scores import ScoreTable, score_forecast, score_regions
from mesh3d.weather.writer import ForecastWriter

__all__ = ["REGIONS", "ForecastProgress", "ForecastResult", "ForecastWriter", "LatLonGrid", "MemberKey", "MemberNoise",
           "Region", "ScoreTable", "SphereConv2d", "acc", "channels_array", "forecast", "forecast_ensemble", "lat_weights",
           "load_forecast_model", "open_climatology", "perturb_initial", "rmse", "rollout", "rollout_loss",
           "run_forecast", "score_forecast", "score_regions", "scores_dataset", "sphere_pad", "weather_extra",
           "weighted_mse", "write_score_files"]

#: Loaded on first use (they import the checkpointer and the planner): ``from mesh3d.weather import run_forecast``.
_LAZY = {"run_forecast": "mesh3d.weather.job", "load_forecast_model": "mesh3d.weather.job"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mesh3d.weather' has no attribute {name!r}")
