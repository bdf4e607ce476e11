"""scripts/gpu_plan_check.py's logic on the CPU: the GPU check's own case code, planned with CPU kernels and measured
with peak RSS in a fresh process (the GPU figures need a GPU: scripts/gpu_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpu_plan_check import cases  # noqa: E402


def _run_cases_body() -> list[dict]:
    import torch
    from gpu_plan_check import run_cases

    from mesh3d import DistributedManager

    DistributedManager.initialize()
    try:
        return run_cases(torch.device("cpu"))
    finally:
        DistributedManager.shutdown()


def test_the_gpu_plan_check_s_cases_plan_within_ten_percent_on_the_cpu(ranks):
    """Every case of the GPU check, smaller, on one CPU rank: parameters and optimizer state exactly as planned, the
    step peak within 10 % of the measured peak RSS growth."""
    rows = ranks.run(1, _run_cases_body, timeout=600, fresh=True)[0]
    assert [r["case"] for r in rows] == [c.name for c in cases("cpu")]
    for row in rows:
        assert "error" not in row, row
        assert row["params_equal"] and row["optimizer_equal"], row
        assert 0.9 <= row["ratio"] <= 1.1, row
