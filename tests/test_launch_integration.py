"""The manager under real launchers, each in fresh processes (not the pool).

These start processes, so there are few of them: one torchrun job of 8 ranks,
one SLURM-style job of 2 ranks started by hand, and a plain ``python -c``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mesh_table.py"


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                          "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plain_python_is_a_world_of_one():
    code = ("from mesh3d import DistributedManager as D; d = D.initialize(); "
            "print(d.world_size, tuple(d.mesh.shape), d.launcher, d.backend); D.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "(1,", "1,", "1)", "none", "gloo"]


def test_torchrun_eight_ranks_infer_the_model_axis():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-port", str(_free_port()),
           str(EXAMPLE), "--batch", "2", "--domain", "2", "--model", "-1"]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh batch=2 x domain=2 x model=2 on 8 rank(s), backend=gloo, launcher=torchrun" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines()[3:]]
    assert len(rows) == 8
    for rank, row in enumerate(rows):
        assert row[:4] == [str(rank), str(rank // 4), str((rank // 2) % 2), str(rank % 2)]


def test_slurm_variables_start_a_two_rank_job():
    port = _free_port()
    code = ("from mesh3d import DistributedManager as D; d = D.initialize(batch=1, domain=-1); "
            "print(d.rank, d.local_rank, d.launcher, d.coordinates['domain'], d.axis_ranks('domain')); D.shutdown()")
    procs = []
    for rank in range(2):
        env = _clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                         SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port), SLURM_JOB_ID="42")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, stderr[-3000:]
        assert stdout.strip() == f"{rank} {rank} slurm {rank} [0, 1]"


def test_bad_sizes_fail_fast_under_torchrun_on_every_rank():
    # NOTE: torchrun's agent ends the other workers as soon as one fails (it polls every 0.1 s); on two
    # busy cores the slower rank can be ended before it gets to the check (importing torch and mesh3d took
    # over 3 s there in CI once). A 15 s poll lets both get there; each fails within seconds of starting.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "--monitor-interval", "15", str(EXAMPLE), "--batch", "3"]
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.count("batch=3 does not divide world size 2") >= 2, out.stderr[-3000:]
