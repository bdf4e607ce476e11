"""A forecast or scoring that fails on some ranks ends on every rank at once, in one line (issue 68, item 5).

- A rank whose write fails mid-campaign (lead 2, on 2x2 blocks) tells its peers through the watch: each raises
  ``PeerLostError`` naming the rank and its error, or (blocked in a collective that cannot be interrupted) the watch
  prints it and ends the process with exit status 76, where before they waited in the lead's barrier or the next halo
  exchange for the group's timeout (two minutes here: that would be a ``CollectiveTimeoutError``);
- ``mesh3d forecast`` with a mesh the ranks do not make says so before any work, in one line printed once (by rank 0,
  naming the ranks that share it), and ``mesh3d score`` with a bad climatology likewise; a rank's own failure is one
  line naming that rank, its peers' one line naming it too.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import forecast_helpers as fh

TIMEOUT_S = 120.0
WATCH = {"interval": 0.25, "suspect_after": 1.0, "dead_after": 4.0, "grace": 2.0}


def _failing_write(case, out, lead):
    import torch.distributed as dist

    from mesh3d import DistributedManager, WatchSettings
    from mesh3d.faults import PeerLostError
    from mesh3d.weather import forecast_ensemble
    from mesh3d.weather.store import ForecastStore

    DistributedManager.initialize(batch=1, domain=(2, 2), model=1, timeout=TIMEOUT_S, watch=WatchSettings(**WATCH))
    rank, real = dist.get_rank(), ForecastStore.write

    def write(self, init, k, member, blocks, rows, cols):
        if rank == 2 and k + 1 == lead:
            raise OSError("disk full (injected)")
        return real(self, init, k, member, blocks, rows, cols)

    ForecastStore.write = write
    try:
        forecast_ensemble(fh.killing_model().net, case["store"], case["variables"], out, init_times=[1], leads=4,
                          members=2, stats=case["stats"], tile=(2, 5), progress=None)
        seen = "finished"
    except PeerLostError as err:
        seen = f"PeerLostError: {err}"
    except OSError as err:
        seen = f"OSError: {err}"
    finally:
        ForecastStore.write = real
    DistributedManager.shutdown()
    return seen


def test_a_rank_failing_mid_forecast_ends_every_rank_at_once_naming_it(ranks, tmp_path):
    from rankpool.pool import RankFailure

    case = fh.sphere_checkpoint(str(tmp_path))
    try:
        seen = dict(enumerate(ranks.run(4, _failing_write, case, str(tmp_path / "fc.zarr"), 2, timeout=240)))
    except RankFailure as failure:   # survivors blocked in a collective: the watch printed the error and ended them
        seen = dict(failure.results)
        for rank, text in re.findall(r"--- rank (\d+) died \(exit code 76\) ---\n(.*?)(?=--- rank|\Z)", str(failure),
                                     re.S):
            seen[int(rank)] = "exit 76: " + text
    assert seen[2] == "OSError: disk full (injected)", seen
    for rank in (0, 1, 3):
        assert re.search(r"PeerLostError: lost rank 2 \(batch 0, domain 2, model 0\): failed with OSError: disk full "
                         r"\(injected\) while the forecast into fc.zarr", seen[rank]), (rank, seen[rank])


def _wrong_mesh(case, out):
    from mesh3d.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):   # a mesh of 2x2 domain ranks x 2 batch ranks: 8 ranks, not 4
        status = main(["forecast", "pkg:model", case["ckpt"], case["store"], "--out", out, "--init", "1", "--leads",
                       "1", "--batch", "2", "--domain", "2x2", "--quiet"])
    return status, printed.getvalue()


def test_mesh3d_forecast_on_a_mesh_the_ranks_do_not_make_says_so_once_before_any_work(ranks, tmp_path):
    case = fh.sphere_checkpoint(str(tmp_path))
    results = ranks.run(4, _wrong_mesh, case, str(tmp_path / "fc.zarr"), timeout=120)
    assert [r[0] for r in results] == [2] * 4
    lines = results[0][1].splitlines()
    assert len(lines) == 1 and lines[0].startswith("mesh3d forecast: "), results[0][1]
    assert "(ranks 0-3: every rank, reported once)" in lines[0] and "8" in lines[0], lines
    assert all(r[1] == "" for r in results[1:]), [r[1] for r in results]
    assert not os.path.exists(str(tmp_path / "fc.zarr"))


def _bad_climatology(store, path):
    from mesh3d.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        status = main(["score", store, "--out", os.path.dirname(store) + "/scores", "--climatology", path,
                       "--domain", "2x2", "--batch", "1"])
    return status, printed.getvalue()


def test_mesh3d_score_with_a_bad_climatology_says_so_once_on_every_rank_of_the_mesh(ranks, tmp_path):
    import numpy as np
    import xarray as xr

    from mesh3d.weather import forecast_ensemble

    case = fh.sphere_checkpoint(str(tmp_path))
    store = str(tmp_path / "fc.zarr")
    forecast_ensemble(fh.killing_model().net, case["store"], case["variables"], store, init_times=[1], leads=1,
                      members=1, stats=case["stats"], tile=(2, 5), progress=None)
    bad = str(tmp_path / "clim.nc")
    xr.Dataset({"z850": (("latitude", "longitude"), np.zeros((3, 3)))}).to_netcdf(bad, engine="h5netcdf")
    results = ranks.run(4, _bad_climatology, store, bad, timeout=120)
    assert [r[0] for r in results] == [2] * 4
    lines = results[0][1].splitlines()
    assert len(lines) == 1 and lines[0].startswith("mesh3d score: ") and "reported once" in lines[0], results[0]
    assert all(r[1] == "" for r in results[1:]), results
