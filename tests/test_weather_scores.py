"""Ensemble scores of a forecast store (mesh3d.weather.score_forecast) on meshes and in one process against an
independent computation here (xarray reads, numpy, explicit member pairs, latitude weights written in the test), in
fp64 to 1e-10: RMSE of the ensemble mean, fair CRPS, spread/skill, ACC per channel and lead; a one-member ensemble's
CRPS is its MAE; leads past the dataset's end are left out; the table, its files and the score figure."""

from __future__ import annotations

import json

import numpy as np
import pytest

import forecast_helpers as fh
from mesh3d.weather import channels_array
import weather_helpers as wh

INITS, LEADS = [1, 3, 5], 4          # init 5 + 4 leads runs past the dataset's 9 times: 2 inits scored at +24 h
TOL = 1e-10


def _forecast(case, out, members):
    from mesh3d.weather import forecast_ensemble

    forecast_ensemble(fh.killing_model().net.double(), case["store"], case["variables"], out, init_times=INITS,
                      leads=LEADS, members=members, stats=case["stats"], perturbation=0.3, tile=(2, 5), batch_size=4,
                      progress=None, restart_every=0)


def _independent(store, case):
    """(scores by name: (leads, channels), inits per lead) from the gathered arrays, written here."""
    import xarray as xr

    fc = xr.open_zarr(store)
    f = channels_array(fc).values                                          # (init, lead, member, C, H, W)
    w = fh.lat_band_weights(fc["latitude"].values)[:, None]
    times = xr.open_zarr(case["store"], consolidated=False)["time"].values
    clim = np.asarray(case["stats"]["mean"])[:, None, None]
    wmean = lambda g: (w * g).mean(axis=(-2, -1))
    out = {k: np.zeros((LEADS, 3)) for k in ("mse", "crps", "var", "acc")}
    count = np.zeros(LEADS)
    m = f.shape[2]
    for i, t0 in enumerate(INITS):
        for k in range(LEADS):
            valid = t0 + k + 1
            if valid >= len(times):
                continue
            o = fh.raw_fields(case["store"], case["variables"], [valid])[0]
            ens = f[i, k]
            mean = ens.mean(axis=0)
            pairs = sum(np.abs(ens[a] - ens[b]) for a in range(m) for b in range(m))
            fair = np.abs(ens - o).mean(axis=0) - (pairs / (2 * m * (m - 1)) if m > 1 else 0)
            out["mse"][k] += wmean((mean - o) ** 2)
            out["crps"][k] += wmean(fair)
            out["var"][k] += wmean(ens.var(axis=0, ddof=1)) if m > 1 else np.nan
            fa, oa = mean - clim, o - clim
            out["acc"][k] += wmean(fa * oa) / np.sqrt(wmean(fa ** 2) * wmean(oa ** 2))
            count[k] += 1
    mean_t = {k: v / count[:, None] for k, v in out.items()}
    rmse, spread = np.sqrt(mean_t["mse"]), np.sqrt(mean_t["var"])
    return {"rmse": rmse, "crps": mean_t["crps"], "spread": spread, "spread_skill": spread / rmse,
            "acc": mean_t["acc"]}, count


def _score_body(store, batch, grid):
    from mesh3d import DistributedManager
    from mesh3d.weather import score_forecast

    DistributedManager.initialize(batch=batch, domain=grid, model=1)
    table = score_forecast(store)
    return {k: getattr(table, k) for k in ("rmse", "crps", "spread", "spread_skill", "acc", "inits")}


def test_scores_on_meshes_equal_an_independent_computation(ranks, tmp_path):
    from mesh3d.weather import score_forecast

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    _forecast(case, store, members=5)
    want, count = _independent(store, case)
    assert count.tolist() == [3, 3, 3, 2] and (want["spread"] > 0).all() and (want["crps"] > 0).all()
    table = score_forecast(store)
    assert table.inits.tolist() == count.tolist() and table.channels == ["z850", "z300", "t2m"]
    for name, value in want.items():
        np.testing.assert_allclose(getattr(table, name), value, rtol=TOL, err_msg=name)
    for batch, grid in ((2, (2,)), (1, (2, 2))):                        # the same from blocks, without a gather
        for got in ranks.run(4, _score_body, store, batch, grid):
            for name, value in want.items():
                np.testing.assert_allclose(got[name], value, rtol=TOL, err_msg=f"{name} on ({batch}, {grid})")

    table.to_csv(tmp_path / "s.csv")
    table.to_json(tmp_path / "s.json")
    rows = json.load(open(tmp_path / "s.json"))["scores"]
    assert rows[2] == {"region": "global", "lead_hours": 6.0, "channel": "t2m", "units": "K", "inits": 3, **{
        k: pytest.approx(float(want[k][0, 2]), rel=TOL) for k in ("rmse", "crps", "spread", "spread_skill", "acc")}}
    text = table.format()
    assert "   24 h  z300" in text and text.count("\n") == LEADS * 3 and "m**2 s**-2" in text


def test_crps_of_a_one_member_ensemble_is_its_mean_absolute_error(tmp_path):
    from mesh3d.weather import score_forecast

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "one.zarr")
    _forecast(case, store, members=1)
    want, _ = _independent(store, case)
    table = score_forecast(store)
    import xarray as xr

    f = channels_array(xr.open_zarr(store)).values[:, :, 0]
    w = fh.lat_band_weights(np.asarray(xr.open_zarr(store)["latitude"].values))[:, None]
    mae = np.zeros((LEADS, 3))
    for k in range(LEADS):
        valid = [(i, t0 + k + 1) for i, t0 in enumerate(INITS) if t0 + k + 1 < wh.T]
        mae[k] = np.mean([(w * np.abs(f[i, k] - fh.raw_fields(case["store"], case["variables"], [t])[0])).mean(
            axis=(-2, -1)) for i, t in valid], axis=0)
    np.testing.assert_allclose(table.crps, mae, rtol=TOL)
    np.testing.assert_allclose(table.rmse, want["rmse"], rtol=TOL)
    assert np.isnan(table.spread).all() and np.isnan(table.spread_skill).all()


def test_score_figure_has_a_line_per_channel_against_lead_time(tmp_path):
    from mesh3d.weather import score_forecast
    from mesh3d.weather.figures import score_figure

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    _forecast(case, store, members=3)
    table = score_forecast(store)
    fig = score_figure(table)
    axes = fig.axes
    assert [a.get_xlabel() for a in axes] == ["lead time (h)"] * 4
    assert [a.get_ylabel() for a in axes] == ["RMSE of the ensemble mean / σ (channel std)", "fair CRPS / σ (channel std)",
                                              "spread / skill", "ACC of the ensemble mean"]
    first = axes[0].get_lines()
    assert [line.get_label() for line in first] == ["z850", "z300", "t2m"]
    np.testing.assert_allclose(first[2].get_ydata(), table.rmse[:, 2] / 30.0, rtol=1e-12)
    np.testing.assert_allclose(first[2].get_xdata(), [6, 12, 18, 24])


def test_forecast_maps_are_labelled_with_units_init_time_model_and_the_errors_rmse():
    from mesh3d.weather.figures import forecast_maps

    g = np.random.default_rng(0)
    lat, lon = np.linspace(80, -80, 9), np.arange(16) * 22.5
    truth = 5500 + 100 * g.standard_normal((2, 9, 16))
    fc = truth + g.standard_normal((2, 9, 16))
    fig = forecast_maps(fc, truth, lat=lat, lon=lon, channel="z500", units="m", init=np.datetime64("2020-01-14T06"),
                        model="SFNO", lead_hours=[6, 48])
    maps = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    bars = [a for a in fig.axes if a.get_label() == "<colorbar>"]
    assert fig.get_suptitle() == "SFNO: z500 from init 2020-01-14T06:00 UTC"
    assert {a.get_xlabel() for a in maps} == {"longitude (°E)"} and {a.get_ylabel() for a in maps} == {"latitude (°N)"}
    assert [b.get_ylabel() for b in bars] == ["z500 (m)", "z500 (m)", "z500 forecast - truth (m)"]
    w = fh.lat_band_weights(lat)[:, None]
    want = np.sqrt((w * (fc[1] - truth[1]) ** 2).mean())
    assert maps[5].get_title() == f"error, +48 h: RMSE {want:.3g} m"
    assert all(len(a.collections) > 0 for a in maps[:4]) and not maps[4].collections   # contours on z, not on the error
    plain = forecast_maps(fc, truth, lat=lat, lon=lon, channel="t2m", units="K", init="2020-01-14T06", model="SFNO",
                          lead_hours=[6, 48])
    assert not any(a.collections for a in plain.axes if a.get_label() != "<colorbar>")   # no contours for temperature


def _failing_rank_body(store, case, out):
    import torch.distributed as dist

    import mesh3d.weather.campaign as campaign
    from mesh3d import DistributedManager
    from mesh3d.checkpoint import CheckpointError
    from mesh3d.weather import forecast_ensemble, score_forecast
    from mesh3d.weather.inputs import ForecastInputs

    DistributedManager.initialize(batch=1, domain=(2, 2), model=1)
    rank, errors = dist.get_rank(), []
    real_raw, real_create = ForecastInputs.raw, campaign.create_store

    def raw(self, when):
        if rank == 2:
            raise OSError("the truth's chunk cannot be read")
        return real_raw(self, when)

    def create(path, spec):
        raise OSError("no space left on device")

    ForecastInputs.raw, campaign.create_store = raw, create
    try:
        for run in (lambda: score_forecast(store),
                    lambda: forecast_ensemble(fh.killing_model().net, case["store"], case["variables"], out,
                                              init_times=[1], leads=1, stats=case["stats"], tile=(2, 5), progress=None)):
            try:
                run()
                errors.append(None)
            except CheckpointError as err:
                errors.append(str(err))
    finally:
        ForecastInputs.raw, campaign.create_store = real_raw, real_create
    return errors


def test_a_rank_failing_to_score_or_to_create_the_store_fails_every_rank_at_once(ranks, tmp_path):
    """A rank that cannot read its block of the truth, or rank 0 failing to create the store, tells every rank:
    all raise the same error naming the rank and its cause, instead of waiting in a collective for the timeout."""
    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    _forecast(case, store, members=2)
    for score_error, create_error in ranks.run(4, _failing_rank_body, store, case, str(tmp_path / "new.zarr"),
                                               timeout=60):
        assert "score_forecast: the sums of this rank's blocks failed on 1 of 4 ranks" in score_error, score_error
        assert "rank 2: OSError: the truth's chunk cannot be read" in score_error, score_error
        assert "forecast: create the store" in create_error and "rank 0: OSError: no space left" in create_error
