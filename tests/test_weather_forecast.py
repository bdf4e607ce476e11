"""Ensemble forecasts from a checkpoint (mesh3d.weather.forecast_ensemble / run_forecast) against one process in fp64:
the weather example's model, 8 members from 3 init times, 10 leads, on (2, 2x2, 1) member by member, the stores'
coordinates, chunks and attributes; members that depend on their seed only (perturbation functions, the model's own
noise, other batchings and meshes); refusals on every rank."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import forecast_helpers as fh
from mesh3d.weather import channels_array

TOL = 1e-12
INITS, MEMBERS, LEADS, SCALE = [40, 45, 50], 4, 6, 0.05
SAMPLES = len(INITS) * MEMBERS  # 12: each of 2 batch ranks forecasts 6, in batches of 5 and 1


def _run_body(case, out, grid, batch, batch_size, dtypes=(torch.float64,)):
    from mesh3d import DistributedManager
    from mesh3d.weather import run_forecast

    if grid is not None:
        DistributedManager.initialize(batch=batch, domain=grid, model=1)
    results = []
    for dtype in dtypes:
        result, _ = run_forecast(case["model"], case["ckpt"], case["store"], out.replace(".zarr", f"{dtype}.zarr"),
                                 init_times=INITS, leads=LEADS, members=MEMBERS, dtype=dtype, perturbation=SCALE, seed=5,
                                 batch_size=batch_size, progress=None, restart_every=0)   # the resume tests keep state
        results.append(result)
    return results[0]


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
    both = (torch.float64, torch.float32)
    alone = _run_body(case, str(tmp_path / "one.zarr"), None, 1, SAMPLES, both)   # one process, every sample in one batch
    assert (alone.written, alone.skipped) == (SAMPLES * LEADS, 0)
    results = ranks.run(8, _run_body, case, str(tmp_path / "mesh.zarr"), (2, 2), 2, 5, both, timeout=300)  # 5, 1
    one, mesh = (str(tmp_path / f"{name}{torch.float64}.zarr") for name in ("one", "mesh"))
    half = SAMPLES // 2
    assert [r.samples for r in results] == [list(range(half))] * 4 + [list(range(half, SAMPLES))] * 4
    assert [(r.written, r.skipped, r.recomputed) for r in results] == [(half * LEADS, 0, 0)] * 8  # each its block, once

    a, b = xr.open_zarr(one), xr.open_zarr(mesh)                   # open_zarr alone: consolidated CF metadata
    assert channels_array(a).dims == ("init_time", "lead_time", "member", "channel", "latitude", "longitude")
    want = channels_array(a).values
    scale = np.abs(want).max(axis=(0, 1, 2, 4, 5), keepdims=True)
    # NOTE: relative to each channel's own magnitude, not element by element: a value near zero (a cancellation) carries
    # fp64's summation-order noise of the larger terms it came from (measured: 1e-15 of the channel, 1e-11 of the value)
    err = np.abs(channels_array(b).values - want) / scale
    assert err.max(initial=0) <= TOL, err.max(axis=(0, 1, 2, 4, 5)).ravel()
    xr.testing.assert_identical(a.drop_vars(list(a.data_vars)), b.drop_vars(list(b.data_vars)))  # coords and attrs
    # one variable per field, with CF units and names; levels as a dimension; a field's levels not forecast stay empty
    assert sorted(a.data_vars) == ["t", "t2m", "u10", "z"] and a["level"].values.tolist() == [500.0, 850.0]
    assert a["z"].dims == ("init_time", "lead_time", "member", "level", "latitude", "longitude") and \
        a["t2m"].dims == ("init_time", "lead_time", "member", "latitude", "longitude")
    assert {k: a["t2m"].attrs[k] for k in ("units", "standard_name")} == {"units": "K", "standard_name": "air_temperature"}
    assert a["z"].attrs["standard_name"] == "geopotential_height" and a["level"].attrs["units"] == "hPa"
    assert a["t"].sel(level=500).isnull().all() and np.array_equal(a["t"].sel(level=850).values, want[:, :, :, 1])
    assert _metadata(one) == _metadata(mesh) and "restart" not in os.listdir(mesh)  # chunks, codecs, attrs; no record left

    # The one-process store against whole fields run here: the documented noise rule, normalization, the plain model.
    net = load_forecast_model(case["model"], case["ckpt"], dtype=torch.float64)
    hand = fh.hand_forecast(net, case["store"], case["variables"], case["stats"], INITS, MEMBERS, LEADS, 5, SCALE)
    np.testing.assert_allclose(want, hand, rtol=1e-12, atol=1e-9)
    assert np.abs(hand[:, -1] - hand[:, -1].mean(axis=1, keepdims=True)).max() > 1e-3   # the members differ
    assert np.isfinite(want).all() and np.abs(hand[:, 0] - hand[:, -1]).max() > 1.0     # and the forecast moves

    # fp32: the mesh's error (against fp64) is of the one-process fp32 run's own rounding, channel by channel.
    one32, mesh32 = (channels_array(xr.open_zarr(str(tmp_path / f"{n}{torch.float32}.zarr"))).values for n in ("one", "mesh"))
    error = lambda got: np.abs(got - want).max(axis=(0, 1, 2, 4, 5))
    assert (error(one32) > 0).all() and (error(mesh32) <= 2 * error(one32)).all(), (error(mesh32), error(one32))
    assert (np.abs(mesh32 - one32).max(axis=(0, 1, 2, 4, 5)) <= 2 * error(one32)).all()

    again = _run_body(case, str(tmp_path / "one.zarr"), None, 1, 4)    # the complete fp64 store: nothing rewritten
    assert (again.written, again.skipped) == (0, SAMPLES * LEADS)


# ---------------------------------------------------------------- members that depend on their seed only
NOISY = {"init_times": [1, 3], "leads": 3, "members": 3, "seed": 11, "tile": (2, 5), "batch_size": 1}


def _noisy_body(case, out, batch, grid, other):
    from mesh3d import DistributedManager
    from mesh3d.weather import forecast_ensemble

    DistributedManager.initialize(batch=batch, domain=grid, model=1)
    kwargs = dict(case=None, **NOISY)
    kwargs.pop("case")
    result = forecast_ensemble(fh.noisy_net(), case["store"], case["variables"], out, stats=case["stats"],
                               perturbation=fh.smooth_perturbation, model_noise=True, progress=None, **kwargs)
    refusals = []
    for bad in ({"tile": (7, 10)}, {"seed": 12}):                  # every rank refuses, naming the fix
        try:
            forecast_ensemble(fh.noisy_net(), case["store"], case["variables"], other if "tile" in bad else out,
                              stats=case["stats"], perturbation=fh.smooth_perturbation, model_noise=True, progress=None,
                              **{**kwargs, **bad})
        except ValueError as err:
            refusals.append(str(err))
    return result.written, refusals


def test_members_depend_on_their_seed_only_with_perturbation_functions_and_the_models_own_noise(ranks, tmp_path):
    import xarray as xr

    from mesh3d.weather import forecast_ensemble

    case = fh.sphere_checkpoint(str(tmp_path), fh.noisy_net)
    one = str(tmp_path / "one.zarr")
    forecast_ensemble(fh.noisy_net(), case["store"], case["variables"], one, stats=case["stats"],
                      perturbation=fh.smooth_perturbation, model_noise=True, progress=None, **NOISY)
    want = channels_array(xr.open_zarr(one)).values
    assert np.abs(want[:, :, 0] - want[:, :, 1]).max() > 1e-3 and np.isfinite(want).all()
    two = str(tmp_path / "two.zarr")                                   # fewer members: the first ones unchanged
    forecast_ensemble(fh.noisy_net(), case["store"], case["variables"], two, stats=case["stats"],
                      perturbation=fh.smooth_perturbation, model_noise=True, progress=None, **{**NOISY, "members": 2})
    np.testing.assert_array_equal(channels_array(xr.open_zarr(two)).values, want[:, :, :2])
    for world, batch, grid in ((4, 2, (2,)), (4, 1, (2, 2))):
        out = str(tmp_path / f"mesh{batch}.zarr")
        results = ranks.run(world, _noisy_body, case, out, batch, grid, str(tmp_path / f"bad{batch}.zarr"))
        np.testing.assert_allclose(channels_array(xr.open_zarr(out)).values, want, rtol=TOL, atol=TOL)
        for written, refusals in results:
            assert written > 0 and len(refusals) == 2
            assert "splits latitude over 2 ranks, but the store has only 1 tiles of 7 points" in refusals[0]
            assert "holds another forecast (seed: 12 vs 11)" in refusals[1]


# ---------------------------------------------------------------- a run stopped mid-way continues where it was
@pytest.mark.parametrize("restart_every", [1, 2, 0])
def test_a_stopped_run_continues_from_the_last_lead_written_without_rewriting_it(tmp_path, restart_every):
    import xarray as xr
    import zarr

    from mesh3d.weather import forecast_ensemble

    case = fh.sphere_checkpoint(str(tmp_path))
    run = dict(init_times=[0, 2], leads=5, members=3, stats=case["stats"], perturbation=0.1, batch_size=2, progress=None,
               tile=(2, 5), restart_every=restart_every)
    plain = fh.killing_model().net
    full, out = str(tmp_path / "full.zarr"), str(tmp_path / "out.zarr")
    forecast_ensemble(fh.Failing(plain, 0), case["store"], case["variables"], full, **run)   # never stops
    with pytest.raises(RuntimeError, match="stopped at call 9"):       # batch 2 of 3 (samples 2, 3), at lead 4
        forecast_ensemble(fh.Failing(plain, 9), case["store"], case["variables"], out, **run)
    done = zarr.open_array(out, path="restart/leads_done", mode="r")[:]
    assert done.tolist() == [5, 5, 3, 3, 0, 0]
    before = fh.chunk_files(out)
    assert {tuple(int(v) for v in p.split("/")[:3]) for p in before} == {
        (i, k, m) for s, d in enumerate(done) for k in range(d) for i, m in [divmod(s, 3)]}
    result = forecast_ensemble(fh.Failing(plain, 0), case["store"], case["variables"], out, **run)
    assert result.skipped == done.sum() and result.written == 6 * 5 - done.sum()       # written once, each lead
    kept = {1: 3, 2: 2, 0: 0}[restart_every]                           # the lead of the state samples 2, 3 resume from
    assert result.recomputed == 2 * (3 - kept)                         # steps re-run without writing
    after = fh.chunk_files(out)
    assert all(after[p] == v for p, v in before.items())               # not one chunk already written was touched
    a, b = xr.open_zarr(full), xr.open_zarr(out)
    np.testing.assert_array_equal(channels_array(b).values, channels_array(a).values)
    xr.testing.assert_identical(a, b)
    assert "restart" not in os.listdir(out)


# ---------------------------------------------------------------- weights over the model axis
def _tensor_parallel_body(case, out, plan):
    from mesh3d import DistributedManager
    from mesh3d.weather import run_forecast

    DistributedManager.initialize(batch=1, domain=2, model=2)
    try:
        result, _ = run_forecast(f"{fh.HERE}:channel_mlp", case["ckpt"], case["store"], out, init_times=[0, 3], leads=3,
                                 members=2, perturbation=0.1, tile=(2, 5), plan=plan, progress=None)
    except ValueError as err:
        return str(err)
    return result.written


def test_weights_split_over_the_model_axis_give_the_one_process_forecast(ranks, tmp_path):
    import xarray as xr

    from mesh3d.weather import run_forecast

    case = fh.sphere_checkpoint(str(tmp_path), fh.channel_mlp)
    one, split = str(tmp_path / "one.zarr"), str(tmp_path / "split.zarr")
    run_forecast(f"{fh.HERE}:channel_mlp", case["ckpt"], case["store"], one, init_times=[0, 3], leads=3, members=2,
                 perturbation=0.1, tile=(2, 5), progress=None)
    written = ranks.run(4, _tensor_parallel_body, case, split, f"{fh.HERE}:mlp_plan")
    assert written == [4 * 3, 0, 4 * 3, 0]                              # model rank 0 of each domain rank writes
    np.testing.assert_allclose(channels_array(xr.open_zarr(split)).values, channels_array(xr.open_zarr(one)).values,
                               rtol=TOL, atol=TOL)
    refused = ranks.run(4, _tensor_parallel_body, case, str(tmp_path / "fsdp.zarr"), "mesh3d:Plan")   # batch="fsdp"
    assert all("keeps the weights whole on each batch rank" in r for r in refused)
