"""``mesh3d forecast`` as the field runs it: started by torchrun on (1, 2, 1), one rank killed mid-run (SIGKILL),
started again under SLURM's variables: the store equals an uninterrupted run's on the same mesh, bit for bit, and no
lead already written is written again (chunk files untouched, writes counted); progress and scores printed."""

from __future__ import annotations

import os
import sys

import numpy as np

import forecast_helpers as fh
from mesh3d.weather import channels_array
from launch_helpers import clean_env, run, run_on_free_port

WORLD = 2
#: The test's model factory imports the tests' helpers by name.
PATH = {"PYTHONPATH": os.pathsep.join([str(fh.ROOT), str(fh.ROOT / "tests")])}
ARGS = ["--init", "1,3,5", "--leads", "6", "--members", "2", "--batch", "1", "--domain", "2", "--tile", "2x5",
        "--perturb", "0.1", "--seed", "4"]


def _uninterrupted_body(case, out):
    from mesh3d import DistributedManager
    from mesh3d.weather import run_forecast

    DistributedManager.initialize(batch=1, domain=2, model=1)
    result, _ = run_forecast(f"{fh.HERE}:killing_model", case["ckpt"], case["store"], out, init_times=[1, 3, 5], leads=6,
                             members=2, perturbation=[0.1], seed=4, tile=(2, 5), progress=None)
    return result.written


def test_forecast_command_killed_mid_run_continues_under_slurm_to_the_uninterrupted_store(ranks, tmp_path):
    import xarray as xr
    import zarr

    case = fh.sphere_checkpoint(str(tmp_path))
    out, scores = str(tmp_path / "fc.zarr"), str(tmp_path / "scores")
    command = ["-m", "mesh3d.cli", "forecast", f"{fh.HERE}:killing_model", case["ckpt"], case["store"], "--out", out,
               *ARGS, "--scores", scores]
    killed = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), *command],
                 **{fh.KILL_ENV: "1:15"}, **PATH)                              # rank 1: its 3rd sample, at lead 3
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr
    done = zarr.open_array(out, path="restart/leads_done", mode="r")[:]
    # NOTE: rank 0 records lead 2 of sample 2 once both ranks wrote it, unless the watch ends it first: inside the
    # campaign's guard a survivor is ended `grace` seconds after the loss even mid-record (seen under load). Then lead 2
    # is written but not recorded, and the resume writes it again; what is recorded is never written again.
    assert done.tolist() in ([6, 6, 2, 0, 0, 0], [6, 6, 1, 0, 0, 0]), done
    recorded = lambda path: int(path.split("/")[1]) < done[int(path.split("/")[0]) * 2 + int(path.split("/")[2])]
    before = {p: v for p, v in fh.chunk_files(out).items() if recorded(p)}   # chunk paths: init/lead/member/...
    assert len(before) == done.sum() * 4 * 2 * fh.channel_count(out)   # 4 x 2 tiles of 2 x 5 points per lead and channel

    def slurm(port):
        return [([sys.executable, *command], clean_env(SLURM_PROCID=str(r), SLURM_NTASKS=str(WORLD), SLURM_LOCALID=str(r),
                                                       SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port), **PATH))
                for r in range(WORLD)]

    again = run_on_free_port(slurm)
    assert all(d.returncode == 0 for d in again), "\n".join(d.stderr[-3000:] for d in again)
    printed = again[0].stdout
    assert f"{2 * (36 - done.sum())} blocks written" in printed           # each remaining lead once, by 2 domain ranks
    assert f"{done.sum()} sample-leads were already written (not rewritten)" in printed
    assert "forecast: batch 6/6 (samples 5-5), lead 6/6 (+36 h)" in printed   # progress
    assert all(fh.chunk_files(out)[p] == v for p, v in before.items())  # not one chunk already written was touched
    assert "z850" in printed and "RMSE" in printed                          # the score table, labelled by channel

    reference = str(tmp_path / "reference.zarr")
    assert sum(ranks.run(WORLD, _uninterrupted_body, case, reference)) == 6 * 6 * 2
    a, b = xr.open_zarr(reference), xr.open_zarr(out)
    np.testing.assert_array_equal(channels_array(b).values, channels_array(a).values)
    xr.testing.assert_identical(a.drop_vars(list(a.data_vars)), b.drop_vars(list(b.data_vars)))
    with open(tmp_path / "scores" / "scores.csv") as f:
        header, *rows = f.read().splitlines()
    assert header == "region,lead_hours,channel,units,inits,rmse,crps,spread,spread_skill,acc" and len(rows) == 6 * 3
    assert (tmp_path / "scores" / "scores.png").stat().st_size > 10_000
