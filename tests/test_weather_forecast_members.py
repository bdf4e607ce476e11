"""An ensemble split across jobs (issue 68, item 3): jobs of disjoint member ranges (``member_range``, ``mesh3d forecast
--member-range START:STOP``) write one store, bitwise the store of one job of every member, whichever job runs on
which mesh; the store stays incomplete (its restart record kept, the other members NaN) until the last job; bad
ranges are refused on every rank before any work."""

from __future__ import annotations

import os

import numpy as np
import pytest

import forecast_helpers as fh
from mesh3d.weather import channels_array

RUN = dict(init_times=[0, 2], leads=4, members=4, seed=3, perturbation=0.1, tile=(2, 5), progress=None)


def _job(case, out, member_range, batch):
    from mesh3d import DistributedManager
    from mesh3d.weather import forecast_ensemble

    if batch:
        DistributedManager.initialize(batch=batch, domain=1, model=1)
    result = forecast_ensemble(fh.killing_model().net, case["store"], case["variables"], out, stats=case["stats"],
                               member_range=member_range, **RUN)
    refusals = []
    for bad in ((2, 5), (3, 3), (-1, 2)):
        try:
            forecast_ensemble(fh.killing_model().net, case["store"], case["variables"], out, stats=case["stats"],
                              member_range=bad, **RUN)
        except ValueError as err:
            refusals.append(str(err))
    return result.samples, result.written, result.skipped, refusals


@pytest.fixture
def one_thread():
    """This process computes with one intra-op thread, as the pooled ranks do (rankpool/worker.py). NOTE: fp32 convs
    round differently with 1 and 2 threads on some CPUs (an AMD EPYC with AVX2: 7e-8 apart; not on the Xeons this test
    first ran on), and bitwise equality across jobs holds for jobs computing alike, which the jobs here must then be."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_jobs_of_disjoint_member_ranges_write_the_store_of_one_job(ranks, tmp_path, one_thread):
    import xarray as xr
    import zarr

    case = fh.sphere_checkpoint(str(tmp_path))
    one, split = str(tmp_path / "one.zarr"), str(tmp_path / "split.zarr")
    _job(case, one, None, None)                                                     # every member, one process
    first = ranks.run(2, _job, case, split, (0, 2), 2, timeout=120)                 # members 0, 1 on 2 batch ranks
    assert [r[0] for r in first] == [[0, 1], [4, 5]]                               # sample = init * 4 + member
    assert [r[1] for r in first] == [2 * 4, 2 * 4] and all(r[2] == 0 for r in first)
    for refusals in (r[3] for r in first):
        assert len(refusals) == 3 and all("0 <= start < stop <= members (4)" in e for e in refusals), refusals
    assert "restart" in os.listdir(split)                                           # not finished: members 2, 3 missing
    done = zarr.open_array(split, path="restart/leads_done", mode="r")[:]
    assert done.tolist() == [4, 4, 0, 0, 4, 4, 0, 0]
    partial = channels_array(xr.open_zarr(split, consolidated=False)).values
    assert np.isfinite(partial[:, :, :2]).all() and np.isnan(partial[:, :, 2:]).all()

    samples, written, skipped, _ = _job(case, split, (2, 4), None)                  # the rest, in one process
    assert samples == [2, 3, 6, 7] and (written, skipped) == (4 * 4, 0)
    a, b = xr.open_zarr(one), xr.open_zarr(split)
    np.testing.assert_array_equal(channels_array(b).values, channels_array(a).values)       # bitwise
    xr.testing.assert_identical(a, b)
    assert "restart" not in os.listdir(split) and sorted(os.listdir(split)) == sorted(os.listdir(one))
    again = _job(case, split, (1, 3), None)                                         # a finished store: nothing rewritten
    assert (again[1], again[2]) == (0, 2 * 2 * 4)


def test_the_cli_takes_a_member_range_and_refuses_a_bad_one(capsys):
    from mesh3d.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["forecast", "examples/weather.py:model", "ckpt", "data.zarr", "--out", "o.zarr", "--init", "0",
                              "--leads", "2", "--members", "10", "--member-range", "5:10"])
    assert args.member_range == (5, 10)
    for bad in ("3:1", "5", "a:b"):
        with pytest.raises(SystemExit):
            parser.parse_args(["forecast", "examples/weather.py:model", "ckpt", "data.zarr", "--out", "o.zarr", "--init", "0", "--leads",
                               "2", "--member-range", bad])
        assert "is not a member range: give START:STOP" in capsys.readouterr().err
