"""Scores per region, per member, chosen metrics and the CF score dataset (issue 68, item 4), against numpy here.

The regions' masks and the per-member scores are written in this file from the gathered store (xarray reads, the
test's own latitude weights and box rule), in fp64 to 1e-10: WeatherBench 2's tropics and northern extra-tropics and a
box across the 0/360 meridian, in one process and from 2x2 blocks (4 ranks, no gather); a region without a grid point
and an unknown metric are refused on every rank before any collective; ``mesh3d score --region ... --metrics ...``
writes a dataset that xarray opens as one variable per field with its units, equal to the tables.
"""

from __future__ import annotations

import json

import numpy as np

import forecast_helpers as fh
from mesh3d.weather import channels_array
import weather_helpers as wh

INITS, LEADS, MEMBERS = [1, 5], 4, 3      # init 5 + 4 leads runs past the dataset's 9 times
TOL = 1e-10
#: (name as given, south, north, west, east): WeatherBench 2's boxes, and one across the meridian (lon 324, 0, 36).
REGIONS = [("tropics", -20, 20, 0, 360), ("extratropics_north", 20, 90, 0, 360), ("seam=-30:60,300:40", -30, 60, 300, 40)]


def _forecast(tmp_path):
    from mesh3d.weather import forecast_ensemble

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    forecast_ensemble(fh.killing_model().net.double(), case["store"], case["variables"], store, init_times=INITS,
                      leads=LEADS, members=MEMBERS, stats=case["stats"], perturbation=0.3, tile=(2, 5), batch_size=4,
                      progress=None, restart_every=0)
    return case, store


def _box(lat, lon, south, north, west, east):
    rows = (lat >= south) & (lat <= north)
    cols = np.ones(lon.shape, bool) if east - west >= 360 else (
        (lon >= west) | (lon <= east) if west > east else (lon >= west) & (lon <= east))
    return rows[:, None] & cols[None, :]


def _independent(store, case, south, north, west, east):
    """Ensemble RMSE, ACC and each member's RMSE and MAE over the box: (leads, C), (leads, C), (leads, M, C) x 2."""
    import xarray as xr

    fc = xr.open_zarr(store)
    f = channels_array(fc).values
    lat, lon = fc["latitude"].values, fc["longitude"].values
    w = fh.lat_band_weights(lat)[:, None] * _box(lat, lon, south, north, west, east)
    wmean = lambda g: (w * g).sum(axis=(-2, -1)) / w.sum()
    clim = np.asarray(case["stats"]["mean"])[:, None, None]
    out = {k: np.zeros((LEADS, 3)) for k in ("mse", "acc")}
    out.update({k: np.zeros((LEADS, MEMBERS, 3)) for k in ("member_mse", "member_mae")})
    count = np.zeros(LEADS)
    for i, t0 in enumerate(INITS):
        for k in range(LEADS):
            if t0 + k + 1 >= wh.T:
                continue
            o = fh.raw_fields(case["store"], case["variables"], [t0 + k + 1])[0]
            ens = f[i, k]
            out["mse"][k] += wmean((ens.mean(axis=0) - o) ** 2)
            fa, oa = ens.mean(axis=0) - clim, o - clim
            out["acc"][k] += wmean(fa * oa) / np.sqrt(wmean(fa ** 2) * wmean(oa ** 2))
            out["member_mse"][k] += wmean((ens - o) ** 2)
            out["member_mae"][k] += wmean(np.abs(ens - o))
            count[k] += 1
    c2, c3 = count[:, None], count[:, None, None]
    return {"rmse": np.sqrt(out["mse"] / c2), "acc": out["acc"] / c2, "member_rmse": np.sqrt(out["member_mse"] / c3),
            "member_mae": out["member_mae"] / c3}


def _scores_on_blocks(store):
    from mesh3d import DistributedManager
    from mesh3d.weather.scores import score_regions

    DistributedManager.initialize(batch=1, domain=(2, 2), model=1)
    tables = score_regions(store, regions=["global"] + [r[0] for r in REGIONS])
    refused = []
    for bad in ({"regions": ["gap=85:89,0:10"]}, {"metrics": ["rmse", "brier"]}, {"regions": ["mediterranean"]}):
        try:
            score_regions(store, **bad)
        except ValueError as err:
            refused.append(str(err))
    return {name: {k: getattr(t, k) for k in ("rmse", "acc", "member_rmse", "member_mae")}
            for name, t in tables.items()}, refused


def test_scores_per_region_and_member_equal_numpy_in_one_process_and_from_blocks(ranks, tmp_path):
    from mesh3d.weather.scores import score_forecast, score_regions

    case, store = _forecast(tmp_path)
    tables = score_regions(store, regions=["global"] + [r[0] for r in REGIONS])
    assert list(tables) == ["global", "tropics", "extratropics_north", "seam"]
    want = {"global": _independent(store, case, -90, 90, 0, 360)}
    want.update({name.split("=")[0]: _independent(store, case, *box) for name, *box in REGIONS})
    assert not np.allclose(want["seam"]["rmse"], want["global"]["rmse"])      # the boxes are not the globe
    np.testing.assert_array_equal(score_forecast(store).rmse, tables["global"].rmse)   # the globe as it always was
    on_blocks = ranks.run(4, _scores_on_blocks, store)
    for name, expected in want.items():
        for key, value in expected.items():
            np.testing.assert_allclose(getattr(tables[name], key), value, rtol=TOL, err_msg=f"{name} {key}")
            for got, _ in on_blocks:
                np.testing.assert_allclose(got[name][key], value, rtol=TOL, err_msg=f"{name} {key} on 2x2 blocks")
    for _, refused in on_blocks:      # every rank refuses, before the all-reduce (else the others would hang in it)
        assert "no grid point lies in region gap (85..89 N, 0..10 E)" in refused[0], refused
        assert "unknown ['brier']; choose from rmse, crps, spread, spread_skill, acc, member_rmse" in refused[1]
        assert "unknown region 'mediterranean': choose from global, tropics" in refused[2], refused


def test_mesh3d_score_writes_regions_and_chosen_metrics_as_a_cf_dataset(tmp_path, capsys):
    import xarray as xr

    from mesh3d.cli import main
    from mesh3d.weather.scores import score_regions

    case, store = _forecast(tmp_path)
    out = tmp_path / "scores"
    assert main(["score", store, "--out", str(out), "--region", "global", "--region", REGIONS[2][0],
                 "--metrics", "rmse,acc,member_mae"]) == 0
    printed = capsys.readouterr().out
    assert "region seam (-30..60 N, 300..40 E), 3 members" in printed and "spread/skill" not in printed
    tables = score_regions(store, regions=["global", REGIONS[2][0]])
    ds = xr.open_dataset(out / "scores.nc", engine="h5netcdf")
    assert sorted(ds.data_vars) == ["t2m", "t2m_member", "z300", "z300_member", "z850", "z850_member"]
    assert ds["z850"].dims == ("metric", "region", "lead_time") and ds["t2m"].attrs["units"] == "K"
    assert ds["metric"].values.tolist() == ["rmse", "acc"] and ds["metric_units"].values.tolist() == ["field", "1"]
    assert ds["region"].values.tolist() == ["global", "seam"] and ds["region_west"].values.tolist() == [0, 300]
    assert ds["lead_time"].attrs["standard_name"] == "forecast_period"
    assert (ds["lead_time"].values / np.timedelta64(1, "h")).tolist() == [6, 12, 18, 24]
    for c, name in enumerate(["z850", "z300", "t2m"]):
        for r, region in enumerate(["global", "seam"]):
            np.testing.assert_allclose(ds[name].sel(metric="rmse", region=region), tables[region].rmse[:, c], rtol=1e-12)
            np.testing.assert_allclose(ds[f"{name}_member"].sel(member_metric="member_mae", region=region),
                                       tables[region].member_mae[:, :, c], rtol=1e-12)
    rows = json.load(open(out / "scores.json"))["scores"]
    assert len(rows) == 2 * LEADS * 3 and set(rows[0]) == {"region", "lead_hours", "channel", "units", "inits", "rmse",
                                                            "acc"}
    with open(out / "scores_members.csv") as f:
        header, *lines = f.read().splitlines()
    assert header == "region,lead_hours,member,channel,units,inits,member_mae" and len(lines) == 2 * LEADS * MEMBERS * 3
    capsys.readouterr()
    assert main(["score", store, "--out", str(out), "--metrics", "rmse,brier"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mesh3d score: metrics: unknown ['brier']; choose from rmse, crps, spread, spread_skill, acc, member_rmse, "
        "member_mae"]
    assert main(["score", store, "--out", str(out), "--region", "alps=44:49"]) == 2
    assert "give a box as NAME=SOUTH:NORTH,WEST:EAST" in capsys.readouterr().err
