"""Smoke test of examples/domain_parallel_cnn.py under torchrun (starts processes: keep it the only one)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_domain_example_matches_one_process_under_torchrun():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT"} and not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           str(ROOT / "examples" / "domain_parallel_cnn.py"), "--steps", "3", "--height", "20", "--width", "8"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MATCHES one process" in out.stdout, out.stdout
