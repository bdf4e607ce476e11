"""The examples, run as their docstrings run them.

Each example checks itself against one process and exits non-zero on a mismatch; these tests also read what it
printed. Their phases run on the rank pool's ranks as torchrun would start them (example_ranks.py says how, and why not
torchrun itself). The SLURM and Lightning examples start their own processes: their launchers are the point. (demo_3d.py
runs in test_demo.py, train_transformer.py in test_parallelize_example.py, domain_parallel_cnn.py in
test_domain_example.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from example_ranks import run_example
from launch_helpers import clean_env, run, run_on_free_port


ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path):
    """A script of the checkout (examples/, scripts/) as a module, by path: they are not a package."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str]) -> str:
    """Runs torchrun with --standalone (no port to race for); the others choose a port themselves, and
    a launch whose port was taken meanwhile is started again (launch_helpers)."""
    done = run(args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_slurm_job_is_preempted_and_resumes_like_one_process(tmp_path):
    root = str(tmp_path / "ckpt")
    first = _run(["examples/slurm_job.py", "--simulate", "4", "--steps", "6", "--preempt-at", "4", "--root", root])
    assert "launcher slurm: 4 ranks" in first and "fresh start" in first and "preempted after step 3" in first
    second = _run(["examples/slurm_job.py", "--simulate", "4", "--steps", "6", "--root", root])
    assert "resumed from" in second and "(step 4)" in second, second
    assert re.search(r"max abs diff \S+: MATCHES one process", second), second
    assert sorted(os.listdir(root)) == ["latest", "step-00000004", "step-00000006"]  # keep_last=2


def test_volume_unet3d_matches_one_process(ranks):
    out = run_example(ranks, 4, "examples/volume_unet3d.py", "--steps", "2")
    assert "MATCHES one process" in out, out
    assert len(re.findall(r"step \d loss [\d.]+ one-process [\d.]+", out)) == 2


def test_pinn_heat_example_trains_equal_to_one_process_on_a_2x2_grid_of_blocks(ranks):
    """Second derivatives of the network's output with respect to the coordinate field, on (batch 1, domain 2x2)."""
    out = run_example(ranks, 4, "examples/pinn_heat.py")
    assert "blocks on 4 ranks: every step's loss and the parameters" in out and "MATCH one process" in out, out
    assert len(re.findall(r"step \d+ loss [\d.]+ one-process [\d.]+", out)) == 15


def test_checkpoint_reshard_example_saves_resumes_elsewhere_and_exports(ranks, tmp_path):
    ck = str(tmp_path / "ck")
    run_example(ranks, 4, "examples/checkpoint_reshard.py", "save", ck, "--mesh", "2,1,2")
    run_example(ranks, 2, "examples/checkpoint_reshard.py", "resume", ck, "--mesh", "1,1,2")
    out = run_example(ranks, 1, "examples/checkpoint_reshard.py", "check", ck)
    assert "coalesced == trained: True" in out, out


def test_lightning_example_under_lightnings_launcher_torchrun_and_slurm(tmp_path):
    """Fit with Lightning's own launcher (plain python), resume on other meshes under torchrun and SLURM."""
    ck = str(tmp_path / "lightning" / "epoch1.ckpt")
    fit = _run(["examples/lightning_3d.py", "fit", "--devices", "4", "--mesh", "1,2,2", "--ckpt", ck])
    assert "(LightningEnvironment)" in fit and "MATCHES one process" in fit, fit
    assert len(re.findall(r"step \d loss [\d.]+ one-process [\d.]+", fit)) == 4
    # NOTE: the resumes run on 2 processes, not 4: each process spends about 5 s importing Lightning here, and a
    # resume onto fewer ranks (domain and model axes gone, or the batch axis gone) reshards as much as onto more.
    torchrun = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/lightning_3d.py",
                     "resume", "--devices", "2", "--mesh", "2,1,1", "--ckpt", ck])
    assert "on 2 processes (TorchElasticEnvironment), global step 8, epoch 2" in torchrun, torchrun
    assert "MATCHES one process" in torchrun, torchrun

    def srun(port):  # srun's variables on two processes started by hand; rank 0 hosts the store on `port`
        return [([sys.executable, "examples/lightning_3d.py", "resume", "--devices", "2", "--mesh", "1,1,2", "--ckpt", ck],
                 clean_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NTASKS="2",
                           SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="mesh3d", SLURM_JOB_ID="7",
                           SLURM_NODELIST="localhost", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port)))
                for rank in range(2)]

    done = run_on_free_port(srun)
    assert all(d.returncode == 0 for d in done), [d.stdout[-2000:] + d.stderr[-2000:] for d in done]
    out = done[0].stdout
    assert "on 2 processes (SLURMEnvironment), global step 8, epoch 2" in out, out
    assert "MATCHES one process" in out, out


def test_data_resume_example_continues_the_same_global_batches_on_another_mesh(ranks, tmp_path):
    """Trained on (2, 2, 1), run again into its folder (it starts afresh, saying what it removed), resumed on (1, 3, 1):
    the same global batches as the uninterrupted run."""
    root = str(tmp_path / "slabs")
    train = ["examples/data_resume.py", "train", "--root", root, "--mesh", "2,2,1", "--steps", "3"]
    first = run_example(ranks, 4, *train)
    assert "starting afresh" not in first and "mesh (2, 2, 1): MATCHES the uninterrupted run" in first, first
    # Checkpoints are never overwritten, so a second run into the folder (it carries the example's marker) removes
    # what the first wrote and says so in one line; the rest of the folder stays.
    (tmp_path / "slabs" / "notes.txt").write_text("the user's")
    again = run_example(ranks, 4, *train)
    assert f"examples/data_resume.py: starting afresh in {root}: removed x.npy, y.npy, ckpt" in again, again
    assert "MATCHES the uninterrupted run" in again and (tmp_path / "slabs" / "notes.txt").read_text() == "the user's"
    second = run_example(ranks, 3, "examples/data_resume.py", "resume", "--root", root, "--mesh", "1,3,1", "--steps", "4")
    assert "resumed step 3 on mesh (1, 3, 1) at epoch 1, position 4" in second, second
    assert "mesh (1, 3, 1): MATCHES the uninterrupted run" in second, second
    steps = re.findall(r"step (\d) ids (\[[\d, ]+\]) loss \S+ \| uninterrupted ids (\[[\d, ]+\])", second)
    assert [int(s) for s, _, _ in steps] == [3, 4, 5, 6] and all(a == b for _, a, b in steps)
    # Depth 10 over 3 domain ranks is (4, 4, 2): each rank read its share of every sample it trained on.
    fractions = sorted(re.findall(r"read \d+ bytes, ([\d.]+) of its samples", second))
    assert fractions == ["0.200", "0.400", "0.400"], second


def test_weather_example_trains_equal_to_one_process_resumes_forecasts_and_draws(ranks, tmp_path):
    """The whole example, phase by phase as its docstring runs them: 8 ranks (batch 2 x 2x2 blocks) beside one process,
    resume on 4 lat slabs, 8-step forecast written block by block and checked against one process, the PNG. Each phase
    exits non-zero unless its checks pass."""
    where = ["--out", str(tmp_path / "weather")]
    out = "".join(run_example(ranks, n, "examples/weather.py", phase, *where)
                  for n, phase in ((1, "data"), (8, "train"), (4, "resume"), (1, "plot")))
    assert out.count("MATCHES one process") == 3, out                      # two trainings and the forecast
    assert len(re.findall(r"step \d loss [\d.]+ one-process [\d.]+", out)) == 7, out
    assert re.search(r"lat \(0, 8\) lon \(0, 64\): read \d+ bytes", out), out    # a lat slab of the resumed mesh
    assert os.path.getsize(tmp_path / "weather" / "forecast.png") > 10_000
    assert re.search(r"lead 48 h  u10   RMSE +[\d.]+ m s-1 \(persistence +[\d.]+\)  ACC [\d.]+", out), out  # by channel
    import xarray as xr

    fc = xr.open_zarr(tmp_path / "weather" / "forecast.zarr")            # CF coordinates, opened by xarray alone
    assert fc["lead_time"].values[-1] == np.timedelta64(48, "h") and str(fc["init_time"].values[0]) == \
        "2020-01-14T00:00:00.000000000"
    assert sorted(fc.data_vars) == ["t", "t2m", "u10", "z"] and fc["latitude"].attrs["units"] == "degrees_north"  # fields
    assert fc["t2m"].attrs["units"] == "K" and bool(fc["z"].sel(level=500).notnull().all())
    from mesh3d.weather import channels_array

    assert channels_array(fc)["channel"].values.tolist() == ["z500", "t850", "t2m", "u10"]         # the model's order


def test_meshgraphnet_example_trains_equal_to_one_process_and_prints_its_halo(ranks):
    out = run_example(ranks, 3, "examples/meshgraphnet.py", "run", "--steps", "3")
    assert "MATCHES one process" in out, out
    assert len(re.findall(r"step \d loss [\d.]+ one-process [\d.]+$", out, re.M)) == 3
    per_layer, gather_all = (int(v) for v in re.search(r"(\d+) bytes per message-passing layer .* against (\d+) bytes", out).groups())
    assert 0 < per_layer < gather_all
    assert re.search(rf"= 4 layers x {per_layer} \+ \d+ for the loss", out), out


def test_graph_weather_example_trains_on_4_ranks_resumes_on_2_equal_to_one_process(ranks, tmp_path):
    where = ["--out", str(tmp_path / "gw")]
    out = "".join(run_example(ranks, n, "examples/graph_weather.py", phase, *where)
                  for n, phase in ((1, "data"), (4, "train"), (2, "resume")))
    assert "trained on (2, 2): MATCHES one process" in out and "resumed on (2, 1): MATCHES one process" in out, out
    assert len(re.findall(r"^step \d loss [\d.]+ one-process [\d.]+$", out, re.M)) == 7
    halos = re.findall(r"halo rows \([\d, ]+\):\s+(\d+) bytes per step, a gather of every node\s+(\d+)", out)
    assert len(halos) == 8 and all(0 < int(h) < int(g) for h, g in halos), out


def test_an_example_leaves_a_folder_it_did_not_mark_alone(tmp_path):
    runs = _script(ROOT / "examples" / "_runs.py")
    theirs = tmp_path / "theirs"
    (theirs / "ckpt").mkdir(parents=True)
    (theirs / "thesis.tex").write_text("keep")
    with pytest.raises(SystemExit, match=r"already holds ckpt, and the folder holds other files and no \.mesh3d-example"):
        runs.fresh_output(theirs, "examples/x.py", ["ckpt"])
    assert sorted(os.listdir(theirs)) == ["ckpt", "thesis.tex"]
    old = tmp_path / "old"  # a run from before the marker: nothing there but what the example writes
    (old / "ckpt").mkdir(parents=True)
    (old / "data.npy").write_text("")
    assert runs.fresh_output(old, "examples/x.py", ["ckpt"], known=["ckpt", "data.npy"]) == ["ckpt"]
    assert sorted(os.listdir(old)) == [runs.MARKER, "data.npy"]
    (old / "ckpt").mkdir()
    with pytest.raises(SystemExit, match="marked by examples/x.py"):
        runs.fresh_output(old, "examples/y.py", ["ckpt"])


def test_every_stated_example_time_is_the_one_in_example_times_json():
    """README.md's table, the other Markdown and the examples' docstrings state each example's time from
    docs/example_times.json alone (scripts/time_examples.py measures and writes them); every example is listed."""
    times = _script(ROOT / "scripts" / "time_examples.py")
    data = json.loads((ROOT / "docs" / "example_times.json").read_text())
    assert {"machine", "torch", "date", "load_at_start", "examples"} <= set(data)
    assert times.problems(data) == []
    stated = times.stated(data)
    assert {name for f, name, _, _ in stated if f == "README.md"} == set(data["examples"]) == set(times.commands(ROOT))
    assert ("docs/weather.md", "weather.py") in {(f, name) for f, name, _, _ in stated}
