"""A forecast store in the names of the tool that reads it (mesh3d/weather/conventions.py): ``cf``, ``weatherbench2``
and ``earth2studio`` stores of the same blocks hold the same values; each opens the way its reader documents it
(WeatherBench 2: ``xarray.open_zarr``, then its ``by_init`` time conventions, a field by name and ``.sel(level=)``,
the ensemble mean over ``realization``; earth2studio: ``xarray.open_dataset``, then its ``InferenceOutputSource``'s
steps: ``to_array("variable")``, a filter on ``ensemble`` and ``time``, valid times from ``time + lead_time``);
a forecast of the weather example on 2 domain ranks written in each convention equals the one-process ``cf`` store
and scores the same; a convention that is not one, or a resume in another, is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import forecast_helpers as fh
from mesh3d.weather import channels_array
from mesh3d.weather.fields import ChannelInfo, FieldArrays
from mesh3d.weather.store import ForecastStore, StoreSpec, create_store, read_spec

CHANNELS = (ChannelInfo("z1000", "z", 1000.0, "m2 s-2"), ChannelInfo("t2m", "t2m", None, "K"),
            ChannelInfo("t500", "t", 500.0, "K"), ChannelInfo("z50", "z", 50.0, "m2 s-2"))
INITS = (np.datetime64("2020-01-01T00", "ns"), np.datetime64("2020-01-02T00", "ns"))
#: (init, lead, member, channel, lat, lon), written block by block
WHOLE = np.random.default_rng(0).standard_normal((2, 3, 2, len(CHANNELS), 9, 12))


def _spec(convention: str = "cf") -> StoreSpec:
    return StoreSpec(INITS, np.timedelta64(6, "h"), 3, 2, CHANNELS, np.linspace(80, -80, 9), np.arange(0, 360, 30.0),
                     (4, 5), "float64", convention=convention)


def _written(tmp_path, convention: str) -> str:
    path = str(tmp_path / f"{convention}.zarr")
    create_store(path, _spec(convention))
    store = ForecastStore(path)
    for i in range(2):
        for k in range(3):
            for rows, cols in (((0, 4), (0, 7)), ((4, 9), (0, 7)), ((0, 9), (7, 12))):   # blocks of a 2 + 1 mesh
                store.write(i, k, 0, WHOLE[i, k, :, :, rows[0]:rows[1], cols[0]:cols[1]], rows, cols)
    store.finish()
    return path


@pytest.mark.parametrize(("convention", "variables", "dims"), [
    ("cf", ["t", "t2m", "z"], ("init_time", "lead_time", "member", "level", "latitude", "longitude")),
    ("weatherbench2", ["t", "t2m", "z"], ("time", "prediction_timedelta", "realization", "level", "latitude", "longitude")),
    ("earth2studio", ["t2m", "t500", "z1000", "z50"], ("time", "lead_time", "ensemble", "lat", "lon")),
])
def test_each_convention_holds_the_blocks_written_under_its_own_names(tmp_path, convention, variables, dims):
    import xarray as xr

    path = _written(tmp_path, convention)
    ds = xr.open_zarr(path)
    assert sorted(ds.data_vars) == variables
    assert ds[variables[-1]].dims == dims and set(ds.dims) == set(dims) | ({"level"} if "level" in dims else set())
    assert ds[dims[1]].dtype.kind == "m" and ds[dims[0]].dtype.kind == "M"   # timedelta leads, datetime inits
    stacked = channels_array(ds)
    assert stacked.dims == (*dims[:3], "channel", *dims[-2:])
    np.testing.assert_array_equal(stacked.values, WHOLE)
    np.testing.assert_array_equal(FieldArrays.open(path, CHANNELS).read(1, 2, (2, 7), (3, 11)), WHOLE[1, 2, :, :, 2:7, 3:11])
    again = read_spec(path)
    assert again.convention == convention and again.differences(_spec(convention)) == []
    assert any(d.startswith("convention:") for d in again.differences(_spec("cf" if convention != "cf" else "earth2studio")))


def test_weatherbench2_reads_it_by_init_without_renames(tmp_path):
    import xarray as xr

    forecast = xr.open_zarr(_written(tmp_path, "weatherbench2"))
    # NOTE: WeatherBench 2's evaluation (weatherbench2/schema.py, apply_time_conventions with by_init=True) renames
    # prediction_timedelta to lead_time and time to init_time, and sets valid_time = init_time + lead_time; its
    # metrics average over the ensemble dim 'realization', its regions select latitude/longitude boxes.
    assert "prediction_timedelta" in forecast.coords and "time" in forecast.coords
    forecast = forecast.rename({"prediction_timedelta": "lead_time", "time": "init_time"})
    forecast.coords["valid_time"] = forecast.init_time + forecast.lead_time
    z = forecast["z"].sel(level=1000).mean("realization")
    np.testing.assert_allclose(z.values, WHOLE[:, :, :, 0].mean(axis=2), rtol=0, atol=1e-15)
    np.testing.assert_array_equal(forecast["t2m"].sel(latitude=slice(40, -40)).values, WHOLE[:, :, :, 1, 2:7])
    assert forecast["valid_time"].values[1, 2] == INITS[1] + np.timedelta64(18, "h")
    assert forecast["z"].attrs["units"] == "m2 s-2" and forecast["level"].attrs["units"] == "hPa"


def test_earth2studio_reads_it_as_an_inference_output(tmp_path):
    import xarray as xr

    # NOTE: earth2studio's InferenceOutputSource (earth2studio/data/xr.py): open_dataset, to_array("variable"),
    # sel(filter_dict) with time kept a list, then dims time, lead_time and variable required, and with one init
    # time the valid times are time + lead_time along a renamed lead_time
    ds = xr.open_dataset(_written(tmp_path, "earth2studio"), engine="zarr")
    da = ds.to_array("variable").sel({"ensemble": 1, "time": [INITS[1]]})
    assert {"time", "lead_time", "variable"} <= set(da.dims)
    valid = da.coords["time"].values[0] + da["lead_time"].values
    da = da.isel(time=0).drop_vars(["time"]).rename({"lead_time": "time"}).assign_coords(time=valid)
    got = da.sel(time=[INITS[1] + np.timedelta64(12, "h")], variable=["z1000", "t2m", "t500"])
    np.testing.assert_array_equal(got.transpose("time", "variable", "lat", "lon").values[0], WHOLE[1, 1, 1, :3])
    assert ds["z50"].attrs["long_name"] == "geopotential at 50 hPa" and ds["t2m"].attrs["units"] == "K"


def test_a_convention_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="convention 'wb2' is not one of cf, weatherbench2, earth2studio"):
        _spec("wb2")


LEADS, MEMBERS, INIT_IDX = 4, 2, [40, 45]


def _forecast_body(case, out, convention):
    from mesh3d import DistributedManager
    from mesh3d.weather import run_forecast, score_forecast

    DistributedManager.initialize(batch=1, domain=2, model=1)
    run_forecast(case["model"], case["ckpt"], case["store"], out, init_times=INIT_IDX, leads=LEADS, members=MEMBERS,
                 dtype=torch.float64, perturbation=0.05, seed=3, progress=None, convention=convention)
    return score_forecast(out).rmse


def test_a_forecast_on_two_domain_ranks_in_each_convention_equals_one_process_and_scores_the_same(ranks, tmp_path):
    import xarray as xr

    from mesh3d.weather import run_forecast, score_forecast

    case = fh.example_checkpoint(str(tmp_path))
    one = str(tmp_path / "one.zarr")
    run_forecast(case["model"], case["ckpt"], case["store"], one, init_times=INIT_IDX, leads=LEADS, members=MEMBERS,
                 dtype=torch.float64, perturbation=0.05, seed=3, progress=None)
    want, want_rmse = channels_array(xr.open_zarr(one)).values, score_forecast(one).rmse
    scale = np.abs(want).max(axis=(0, 1, 2, 4, 5), keepdims=True)
    for convention in ("weatherbench2", "earth2studio"):
        out = str(tmp_path / f"{convention}.zarr")
        rmse = ranks.run(2, _forecast_body, case, out, convention, timeout=240)
        got = xr.open_zarr(out)
        assert read_spec(out).convention == convention
        err = np.abs(channels_array(got).values - want) / scale   # fp64 on 2 latitude slabs against one process
        assert err.max() <= 1e-12, (convention, err.max())
        for r in rmse:
            np.testing.assert_allclose(r, want_rmse, rtol=1e-10)
