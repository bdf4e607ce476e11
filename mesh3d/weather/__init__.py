"""Weather and climate on the mesh: a lat x lon grid that means the sphere, latitude-weighted loss and metrics,
autoregressive rollout and forecasts written block by block.

Usage::

    from mesh3d.weather import LatLonGrid, SphereConv2d, weighted_mse, rmse, acc, rollout_loss, forecast, ForecastWriter
    grid = LatLonGrid(ds.lat, ds.lon)                   # global coordinates (a WeatherDataset has them)
    conv = SphereConv2d(c, c, 3)                        # longitude periodic (across the seam), latitude not
    loss = rollout_loss(model, x, ys, lambda p, t: weighted_mse(p, t, grid.weights))   # fed back, checkpointed
    forecast(model, x, 8, ForecastWriter("fc.zarr", num_samples, 8, like=x), sample_ids=ids)  # each rank its block

See docs/weather.md.
"""

from mesh3d.weather.grid import LatLonGrid, SphereConv2d, lat_weights, sphere_pad
from mesh3d.weather.metrics import acc, rmse, weighted_mse
from mesh3d.weather.rollout import forecast, rollout, rollout_loss
from mesh3d.weather.writer import ForecastWriter

__all__ = ["ForecastWriter", "LatLonGrid", "SphereConv2d", "acc", "forecast", "lat_weights", "rmse", "rollout",
           "rollout_loss", "sphere_pad", "weighted_mse"]
