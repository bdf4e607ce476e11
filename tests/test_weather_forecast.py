"""Ensemble forecasts from a checkpoint (mesh3d.weather.forecast_ensemble / run_forecast) against one process in fp64:
the weather example's model, 8 members from 3 init times, 10 leads, on (2, 2x2, 1) member by member, the stores'
coordinates, chunks and attributes; members that depend on their seed only (perturbation functions, the model's own
noise, other batchings and meshes); refusals on every rank."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

import forecast_helpers as fh

TOL = 1e-12
INITS, MEMBERS, LEADS, SCALE = [40, 45, 50], 8, 10, 0.05


def _run_body(case, out, grid, batch, batch_size):
    from mesh3d import DistributedManager
    from mesh3d.weather import run_forecast

    if grid is not None:
        DistributedManager.initialize(batch=batch, domain=grid, model=1)
    result, _ = run_forecast(case["model"], case["ckpt"], case["store"], out, init_times=INITS, leads=LEADS,
                             members=MEMBERS, dtype=torch.float64, perturbation=SCALE, seed=5, batch_size=batch_size,
                             progress=None)
    return result


def _metadata(path):
    """Every zarr.json of the store but the consolidated copy, by relative path (coordinates, chunks, attributes)."""
    out = {}
    for d, _, files in os.walk(path):
        if "zarr.json" in files:
            with open(os.path.join(d, "zarr.json")) as f:
                meta = json.load(f)
            meta.pop("consolidated_metadata", None)
            out[os.path.relpath(d, path)] = meta
    return out


def test_ensemble_of_the_weather_example_on_a_mesh_equals_one_process_member_by_member(ranks, tmp_path):
    import xarray as xr

    from mesh3d.weather import load_forecast_model

    case = fh.example_checkpoint(str(tmp_path))
    one, mesh = str(tmp_path / "one.zarr"), str(tmp_path / "mesh.zarr")
    alone = _run_body(case, one, None, 1, 24)                      # one process, all 24 samples in one batch
    assert (alone.written, alone.skipped) == (24 * LEADS, 0)
    results = ranks.run(8, _run_body, case, mesh, (2, 2), 2, 5, timeout=300)   # batches of 5, 5, 2 per batch rank
    assert [r.samples for r in results] == [list(range(12))] * 4 + [list(range(12, 24))] * 4
    assert [(r.written, r.skipped, r.recomputed) for r in results] == [(12 * LEADS, 0, 0)] * 8  # each its block, once

    a, b = xr.open_zarr(one), xr.open_zarr(mesh)                   # open_zarr alone: consolidated CF metadata
    assert a["forecast"].dims == ("init_time", "lead_time", "member", "channel", "latitude", "longitude")
    want = a["forecast"].values
    scale = np.abs(want).max(axis=(0, 1, 2, 4, 5), keepdims=True)
    np.testing.assert_allclose(b["forecast"].values, want, rtol=TOL, atol=0)
    assert np.abs(b["forecast"].values - want).max(initial=0) <= TOL * scale.max()
    xr.testing.assert_identical(a.drop_vars("forecast"), b.drop_vars("forecast"))   # every coordinate and attribute
    assert _metadata(one) == _metadata(mesh) and "restart" not in os.listdir(mesh)  # chunks, codecs, attrs; no record left

    # The one-process store against whole fields run here: the documented noise rule, normalization, the plain model.
    net = load_forecast_model(case["model"], case["ckpt"], dtype=torch.float64)
    hand = fh.hand_forecast(net, case["store"], case["variables"], case["stats"], INITS, MEMBERS, LEADS, 5, SCALE)
    np.testing.assert_allclose(want, hand, rtol=1e-12, atol=1e-9)
    assert np.abs(hand[:, -1] - hand[:, -1].mean(axis=1, keepdims=True)).max() > 1e-3   # the members differ
    assert np.isfinite(want).all() and np.abs(hand[:, 0] - hand[:, -1]).max() > 1.0     # and the forecast moves

    again = _run_body(case, one, None, 1, 4)                        # a complete store: nothing is written again
    assert (again.written, again.skipped) == (0, 24 * LEADS)
