"""The manager under real launchers, each in fresh processes (not the pool).

These start processes, so there are few of them: one torchrun job of 8 ranks,
SLURM-style jobs of 2 ranks started by hand (one of them on a port that is taken at first),
a plain ``python -c``, and docs/getting-started.md's first script as a plain process and under torchrun (4 ranks).
"""

from __future__ import annotations

import re
import socket
import sys

import launch_helpers
import pytest
from doc_blocks import doc_blocks
from launch_helpers import ROOT, clean_env, run, run_on_free_port

EXAMPLE = str(ROOT / "examples" / "mesh_table.py")


def _first_script(tmp_path) -> str:
    """docs/getting-started.md's ``hello_mesh.py``, written where a reader would save it."""
    block = next(b for b in doc_blocks() if b.lang == "python" and b.text.startswith("# hello_mesh.py"))
    path = tmp_path / "hello_mesh.py"
    path.write_text(block.text)
    return str(path)


def test_the_first_script_of_the_guide_prints_its_mesh_in_a_world_of_one_and_under_torchrun(tmp_path):
    script = _first_script(tmp_path)
    alone = run([script], timeout=120)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "[rank 0 b0 d0 m0] INFO mesh3d.__main__: I am at {'batch': 0, 'domain': 0, 'model': 0}" in alone.stderr, alone.stderr
    assert "mesh {'batch': 1, 'domain': 1, 'model': 1}, world size 1" in alone.stderr
    four = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", script])
    assert four.returncode == 0, four.stderr[-3000:]
    for rank in range(4):
        assert f"[rank {rank} b0 d{rank // 2} m{rank % 2}] INFO mesh3d.__main__: I am at" in four.stderr, four.stderr
    assert four.stderr.count("mesh {'batch': 1, 'domain': 2, 'model': 2}, world size 4") == 1


def test_plain_python_is_a_world_of_one():
    code = ("from mesh3d import DistributedManager as D; d = D.initialize(); "
            "print(d.world_size, tuple(d.mesh.shape), d.launcher, d.backend); D.shutdown()")
    out = run(["-c", code], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "(1,", "1,", "1)", "none", "gloo"]


def test_torchrun_eight_ranks_infer_the_model_axis():
    # --standalone: torchrun's store binds a port of the system's choosing (no port to race for).
    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", EXAMPLE,
               "--batch", "2", "--domain", "2", "--model", "-1"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh batch=2 x domain=2 x model=2 on 8 rank(s), backend=gloo, launcher=torchrun" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines()[3:]]
    assert len(rows) == 8
    for rank, row in enumerate(rows):
        assert row[:4] == [str(rank), str(rank // 4), str((rank // 2) % 2), str(rank % 2)]


def test_slurm_variables_start_a_two_rank_job():
    code = ("from mesh3d import DistributedManager as D; d = D.initialize(batch=1, domain=-1); "
            "print(d.rank, d.local_rank, d.launcher, d.coordinates['domain'], d.axis_ranks('domain')); D.shutdown()")

    def start(port):  # srun's variables on two processes started by hand; rank 0 hosts the store on `port`
        return [([sys.executable, "-c", code],
                 clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                           SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port), SLURM_JOB_ID="42"))
                for rank in range(2)]

    for rank, done in enumerate(run_on_free_port(start, timeout=120)):
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == f"{rank} {rank} slurm {rank} [0, 1]"


# A rank that gets to the error seconds after the other (imports on a busy machine): the example, started late on one
# rank. The launcher's script is the example itself, run as __main__ after the delay.
_LATE_RANK = """import os, runpy, sys, time
if os.environ["RANK"] == os.environ["MESH3D_TEST_LATE_RANK"]:
    time.sleep(float(os.environ["MESH3D_TEST_LATE_S"]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("late", ["0", "1"], ids=["reporting-rank-late", "quiet-rank-late"])
def test_bad_sizes_fail_fast_under_torchrun_on_every_rank_and_the_cause_is_printed_once(tmp_path, late):
    """Each rank fails by itself on the same bad request, whichever gets there first (exit_order.py): torchrun polls
    every 2 s here and one rank arrives 5 s after the other. Before the ranks agreed their exit order, the early rank
    ended, torchrun's next poll ended the late one with SIGTERM, and when the late one was the reporting rank the
    cause was never printed."""
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK)
    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--monitor-interval", "2",
               str(script), EXAMPLE, "--batch", "3"], timeout=120, MESH3D_TEST_LATE_RANK=late, MESH3D_TEST_LATE_S="5")
    assert out.returncode != 0
    # every rank failed by itself (exit status 1 in torchrun's report, not ended by torchrun's SIGTERM) ...
    assert len(re.findall(r"exitcode\s*: 1 ", out.stderr)) == 2, out.stderr[-3000:]
    # ... and the shared cause is printed once by rank 0, with the launch that fits, then named by torchrun's report
    printed = re.findall(r"^mesh3d: error on ranks 0, 1: ValueError: batch=3 does not divide world size 2", out.stderr, re.M)
    assert len(printed) == 1, out.stderr[-3000:]
    assert "launch 3 processes (torchrun --nproc-per-node 3" in out.stderr
    assert "traceback : mesh3d: error on ranks 0, 1: ValueError: batch=3" in out.stderr, out.stderr[-3000:]
    ranks_said = out.stderr.split("torch/distributed/elastic")[0]  # what the ranks printed, before torchrun's report
    assert "Traceback (most recent call last)" not in ranks_said, out.stderr[-3000:]


def test_a_launch_whose_port_was_taken_starts_again_on_another(monkeypatch):
    """The retry itself: the first port handed out is held by another listener, as when a process binds it
    between launch_helpers.free_port() and rank 0's store; rank 0 fails with EADDRINUSE, the job runs again."""
    code = "from mesh3d import DistributedManager as D; d = D.initialize(); print(d.rank, d.world_size); D.shutdown()"
    started = []

    def start(port):
        started.append(port)
        return [([sys.executable, "-c", code], clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                                          SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port)))
                for rank in range(2)]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        handed_out = iter([taken_port])
        real_free_port = launch_helpers.free_port
        monkeypatch.setattr(launch_helpers, "free_port", lambda: next(handed_out, None) or real_free_port())
        done = run_on_free_port(start, timeout=120)
    assert len(started) == 2 and started[0] == taken_port != started[1], started
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert [d.stdout.split() for d in done] == [["0", "2"], ["1", "2"]]
