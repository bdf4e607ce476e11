"""ACC against a climatology file (issue 68, item 4): ``mesh3d score --climatology PATH`` and
``score_forecast(climatology=open_climatology(path))`` with one variable per channel (fields on the grid, or a
single value) equal an independent numpy computation in one process and from 2x2 blocks; a climatology lacking a
channel, of another shape or with latitudes the other way is refused on every rank before the all-reduce, and by
the command in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import forecast_helpers as fh
from mesh3d.weather import channels_array

INITS, LEADS, TOL = [1, 3], 3, 1e-10


def _case(tmp_path):
    import xarray as xr

    from mesh3d.weather import forecast_ensemble

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    forecast_ensemble(fh.killing_model().net.double(), case["store"], case["variables"], store, init_times=INITS,
                      leads=LEADS, members=3, stats=case["stats"], perturbation=0.3, tile=(2, 5), progress=None)
    truth = xr.open_zarr(case["store"], consolidated=False)
    raw = fh.raw_fields(case["store"], case["variables"], list(range(truth.sizes["time"])))   # (T, C, H, W)
    rng = np.random.default_rng(0)
    fields = raw.mean(axis=0) + rng.normal(0, 5, raw.shape[1:])         # a climatology that is not the stats' means
    lat, lon = truth["lat"].values, truth["lon"].values
    clim = xr.Dataset({"z850": (("latitude", "longitude"), fields[0]), "z300": (("latitude", "longitude"), fields[1]),
                       "t2m": ((), float(fields[2].mean()))}, coords={"latitude": lat, "longitude": lon})
    path = str(tmp_path / "clim.nc")
    clim.to_netcdf(path)
    want = np.stack([fields[0], fields[1], np.full_like(fields[2], float(fields[2].mean()))])
    return case, store, path, clim, want, raw


def _independent_acc(store, raw, clim):
    import xarray as xr

    f = channels_array(xr.open_zarr(store)).values.mean(axis=2)              # the ensemble mean (init, lead, C, H, W)
    w = fh.lat_band_weights(xr.open_zarr(store)["latitude"].values)[:, None]
    wmean = lambda g: (w * g).mean(axis=(-2, -1))
    acc = np.zeros((LEADS, 3))
    for i, t0 in enumerate(INITS):
        for k in range(LEADS):
            fa, oa = f[i, k] - clim, raw[t0 + k + 1] - clim
            acc[k] += wmean(fa * oa) / np.sqrt(wmean(fa ** 2) * wmean(oa ** 2))
    return acc / len(INITS)


def _score_body(store, path, bad):
    from mesh3d import DistributedManager
    from mesh3d.weather import open_climatology, score_forecast

    DistributedManager.initialize(batch=1, domain=(2, 2), model=1)
    acc = score_forecast(store, climatology=open_climatology(path)).acc
    refused = []
    for other in bad:
        try:
            score_forecast(store, climatology=open_climatology(other))
        except ValueError as err:
            refused.append(str(err))
    try:                                                                  # an array of the wrong grid, every rank
        score_forecast(store, climatology=np.zeros((3, 4, 4)))
    except ValueError as err:
        refused.append(str(err))
    return acc, refused


def test_acc_against_a_climatology_file_equals_numpy_and_bad_ones_are_refused(ranks, tmp_path, capsys):
    from mesh3d.cli import main
    from mesh3d.weather import open_climatology, score_forecast

    case, store, path, clim, want_clim, raw = _case(tmp_path)
    want = _independent_acc(store, raw, want_clim)
    default = score_forecast(store).acc                                   # the stats' means as climatology
    assert np.abs(default - want).max() > 1e-3                            # so the file's climatology is what is used
    np.testing.assert_allclose(score_forecast(store, climatology=open_climatology(path)).acc, want, rtol=TOL)

    bad = {"lacks": str(tmp_path / "lacks.nc"), "shape": str(tmp_path / "shape.nc"), "flipped": str(tmp_path / "flip.nc")}
    clim.drop_vars("t2m").to_netcdf(bad["lacks"])
    clim.isel(longitude=slice(0, 3)).to_netcdf(bad["shape"])
    clim.isel(latitude=slice(None, None, -1)).to_netcdf(bad["flipped"])
    for acc, refused in ranks.run(4, _score_body, store, path, list(bad.values()), timeout=120):
        np.testing.assert_allclose(acc, want, rtol=TOL)                   # from 2x2 blocks, each reading its block
        assert "lacks channels ['t2m']" in refused[0] and "has shape" in refused[1], refused
        assert "latitudes" in refused[2] and "in its order" in refused[2], refused
        assert "must be (C,) or (C, H, W) = (3," in refused[3], refused

    out = tmp_path / "scores"
    assert main(["score", store, "--out", str(out), "--climatology", path]) == 0
    rows = json.load(open(out / "scores.json"))["scores"]
    assert [r["acc"] for r in rows] == pytest.approx(want.ravel().tolist(), rel=TOL)
    capsys.readouterr()
    assert main(["score", store, "--out", str(out), "--climatology", bad["lacks"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mesh3d score: the climatology lacks channels ['t2m']"), err
