"""Open forecast stores with the readers' own code: WeatherBench 2 and earth2studio, where they are installed.

The suite (tests/test_weather_store_conventions.py) follows each reader's documented steps with xarray alone; this
script runs the readers themselves, which the suite cannot depend on (WeatherBench 2 is not on PyPI; earth2studio
requires gcsfs, s3fs, pygrib and netCDF4 among others):

- WeatherBench 2 (``pip install git+https://github.com/google-research/weatherbench2``): a ``weatherbench2`` store
  through ``schema.apply_time_conventions(by_init=True)`` (latitudes made increasing first, as its evaluation
  does), then ``metrics.RMSESqrtBeforeTimeAvg`` of the ensemble mean against a random truth on the valid times,
  checked against numpy, and ``metrics.CRPS`` over ``realization``;
- earth2studio (``pip install earth2studio``): an ``earth2studio`` store through ``InferenceOutputSource`` with a
  member and an init time chosen, a lead's fields read by valid time and variable, checked equal to what was written.

Usage::

    python scripts/check_store_readers.py          # prints one line per reader: ok, FAILED (why), or not installed
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mesh3d.weather import channels_array  # noqa: E402
from mesh3d.weather.fields import ChannelInfo  # noqa: E402
from mesh3d.weather.store import ForecastStore, StoreSpec, create_store  # noqa: E402

CHANNELS = (ChannelInfo("z500", "z", 500.0, "m2 s-2"), ChannelInfo("t2m", "t2m", None, "K"),
            ChannelInfo("t850", "t", 850.0, "K"), ChannelInfo("z850", "z", 850.0, "m2 s-2"))
INITS = (np.datetime64("2020-01-01T00", "ns"), np.datetime64("2020-01-02T00", "ns"))
LAT, LON = np.linspace(80, -80, 9), np.arange(0, 360, 30.0)


def write_store(root: Path, convention: str, whole: np.ndarray) -> str:
    """A store of ``whole`` ``(init, lead, member, channel, lat, lon)``, written in three blocks per lead."""
    path = str(root / f"{convention}.zarr")
    create_store(path, StoreSpec(INITS, np.timedelta64(6, "h"), whole.shape[1], whole.shape[2], CHANNELS, LAT, LON,
                                 (4, 5), "float64", convention=convention))
    store = ForecastStore(path)
    for i in range(whole.shape[0]):
        for k in range(whole.shape[1]):
            for rows, cols in (((0, 4), (0, 7)), ((4, 9), (0, 7)), ((0, 9), (7, 12))):
                store.write(i, k, 0, whole[i, k, :, :, rows[0]:rows[1], cols[0]:cols[1]], rows, cols)
    store.finish()
    return path


def check_weatherbench2(root: Path, whole: np.ndarray) -> str:
    import xarray as xr
    from weatherbench2 import metrics, schema

    stored = xr.open_zarr(write_store(root, "weatherbench2", whole))
    forecast = schema.apply_time_conventions(stored.isel(latitude=slice(None, None, -1)), by_init=True)
    valid = np.unique(forecast.valid_time.values)
    g = np.random.default_rng(1)
    truth = xr.Dataset({"t2m": (("time", "latitude", "longitude"), g.standard_normal((valid.size, 9, 12))),
                        "z": (("time", "level", "latitude", "longitude"),
                              g.standard_normal((valid.size, forecast.level.size, 9, 12)))},
                       coords={"time": valid, "level": forecast.level.values, "latitude": forecast.latitude.values,
                               "longitude": forecast.longitude.values})
    obs = truth.sel(time=forecast.valid_time).drop_vars("time")   # by init: the truth at each valid time
    mean = forecast[["t2m", "z"]].mean("realization")
    rmse = metrics.RMSESqrtBeforeTimeAvg().compute(mean, obs[["t2m", "z"]])
    metrics.CRPS(ensemble_dim="realization").compute(forecast[["t2m", "z"]], obs[["t2m", "z"]])
    w = metrics.get_lat_weights(forecast).values
    err = (mean["t2m"] - obs["t2m"]).values          # (init, lead, lat, lon)
    want = np.sqrt((err ** 2 * (w / w.mean())[:, None]).mean(axis=(-2, -1))).mean(axis=0)
    if not np.allclose(rmse["t2m"].values, want, rtol=1e-12):
        return f"FAILED: RMSE {rmse['t2m'].values} vs numpy {want}"
    return f"ok (RMSE per lead equals numpy: {np.round(want, 4).tolist()}; CRPS over realization computed)"


def check_earth2studio(root: Path, whole: np.ndarray) -> str:
    from earth2studio.data import InferenceOutputSource

    source = InferenceOutputSource(write_store(root, "earth2studio", whole),
                                   filter_dict={"ensemble": 1, "time": INITS[1]}, engine="zarr")
    got = source(INITS[1] + np.timedelta64(12, "h"), ["z500", "t2m", "t850"])
    values = got.transpose("time", "variable", "lat", "lon").values[0]
    if not np.array_equal(values, whole[1, 1, 1, :3]):
        return "FAILED: the fields read differ from those written"
    return "ok (init 1, member 1, +12 h: z500, t2m, t850 equal to those written)"


def main() -> int:
    whole = np.random.default_rng(0).standard_normal((2, 3, 2, len(CHANNELS), 9, 12))
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # NOTE: the cf store first: the same blocks, read back by mesh3d, are the reference the others were written from
        assert np.array_equal(channels_array(__import__("xarray").open_zarr(write_store(root, "cf", whole))).values, whole)
        for name, check in (("weatherbench2", check_weatherbench2), ("earth2studio", check_earth2studio)):
            try:
                line = check(root, whole)
            except ImportError as err:
                line = f"not installed ({err.name or err})"
            except Exception as err:  # noqa: BLE001 (reported: the point of the script)
                line = f"FAILED: {type(err).__name__}: {err}"
            failed |= line.startswith("FAILED")
            print(f"{name}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
