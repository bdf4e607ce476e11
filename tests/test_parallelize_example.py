"""Smoke test: examples/train_transformer.py under torchrun (4 CPU ranks, batch=2 × model=2, 2 steps).

The one subprocess test of this feature (starting ranks costs ~10 s here). fp32 with AdamW over
2 steps: the printed parallel and one-process losses agree to 1e-4 relative (they differ only in
summation order; the equivalence suite checks fp64 bit-tight elsewhere).
"""

from __future__ import annotations

import re

from example_ranks import run_example




def test_example_trains_like_one_process(ranks):
    out = run_example(ranks, 4, "examples/train_transformer.py", "--batch", "2", "--model", "2", "--steps", "2")
    pairs = [(float(a), float(b)) for a, b in re.findall(r"loss ([\d.]+)\s+one-process ([\d.]+)", out)]
    assert len(pairs) == 2, out
    for got, want in pairs:
        assert abs(got - want) <= 1e-4 * want, pairs
    assert pairs[-1][1] < pairs[0][1]  # it trains
