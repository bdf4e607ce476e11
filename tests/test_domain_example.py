"""Smoke test of examples/domain_parallel_cnn.py under torchrun (starts processes: keep it the only one)."""

from __future__ import annotations

from launch_helpers import run


def test_domain_example_matches_one_process_under_torchrun():
    # --standalone: torchrun's store binds a port of the system's choosing (no port to race for).
    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/domain_parallel_cnn.py", "--steps", "3", "--height", "20", "--width", "8"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MATCHES one process" in out.stdout, out.stdout
