"""Smoke test of examples/domain_parallel_cnn.py as torchrun runs it, on 2 pooled ranks (tests/example_ranks.py)."""

from __future__ import annotations

from example_ranks import run_example


def test_domain_example_matches_one_process(ranks):
    out = run_example(ranks, 2, "examples/domain_parallel_cnn.py", "--steps", "3", "--height", "20", "--width", "8")
    assert "MATCHES one process" in out, out
