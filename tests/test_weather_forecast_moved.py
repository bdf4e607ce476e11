"""A forecast store continued from inputs that moved (issue 68, item 6): a checkpoint and a dataset found at new paths
with the same content continue the store (nothing rewritten) and the store records where they are now, so scoring
reads the dataset there, and so does a dataset that grew (times appended); other weights or a dataset of other times
or channels are refused, naming what differs."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import forecast_helpers as fh
from mesh3d.weather import channels_array

RUN = dict(init_times=[0, 2], leads=3, members=2, perturbation=0.1, tile=(2, 5), progress=None)


def test_moved_inputs_continue_the_store_and_other_content_is_refused(tmp_path):
    import xarray as xr

    from mesh3d import checkpoint
    from mesh3d.weather import run_forecast, score_forecast
    from mesh3d.weather.store import read_spec

    case = fh.sphere_checkpoint(str(tmp_path / "a"))
    model, out = f"{fh.HERE}:killing_model", str(tmp_path / "fc.zarr")
    first, _ = run_forecast(model, case["ckpt"], case["store"], out, **RUN)
    assert first.written == 4 * 3
    before = channels_array(xr.open_zarr(out)).values

    moved = tmp_path / "b"
    moved.mkdir()
    ckpt, data = str(moved / "ckpt"), str(moved / "w.zarr")
    shutil.move(case["ckpt"], ckpt)
    shutil.move(case["store"], data)
    again, _ = run_forecast(model, ckpt, data, out, **RUN)
    assert (again.written, again.skipped) == (0, 4 * 3)                  # followed: nothing rewritten
    run = read_spec(out).run
    assert (run["checkpoint"], run["source"]) == (os.path.abspath(ckpt), os.path.abspath(data))
    np.testing.assert_array_equal(channels_array(xr.open_zarr(out)).values, before)
    assert np.isfinite(score_forecast(out).rmse).all()                    # the truth read where it lies now

    grown = str(moved / "grown.zarr")                                     # new times appended since: continues too
    ds = xr.open_zarr(data, consolidated=False)
    later = ds.assign_coords(time=ds["time"].values + ds.sizes["time"] * (ds["time"].values[1] - ds["time"].values[0]))
    xr.concat([ds, later], dim="time").to_zarr(grown, mode="w", consolidated=False, zarr_format=3)
    assert run_forecast(model, ckpt, grown, out, **RUN)[0].skipped == 4 * 3

    other = str(moved / "other")                                          # other weights at the recorded path's name
    net = fh.killing_model()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    checkpoint.save(other, net, step=3, extra=checkpoint.read_index(ckpt)["extra"])
    with pytest.raises(ValueError, match="holds another forecast .*weights"):
        run_forecast(model, other, data, out, **RUN)

    shifted = str(moved / "shifted.zarr")                                 # the same grid, other times
    ds.assign_coords(time=ds["time"].values + np.timedelta64(1, "D")).to_zarr(shifted, mode="w", consolidated=False,
                                                                            zarr_format=3)
    with pytest.raises(ValueError, match="holds another forecast .*source_digest"):
        run_forecast(model, ckpt, shifted, out, **RUN)
