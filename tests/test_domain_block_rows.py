"""A row read by an int index on a block dim, and writes into blocks (issue 67: torch-harmonics' resampling pads a
row at each pole and writes the mean of the ring beside it), against one process in fp64 on uneven 2x2 blocks with an
empty block: values and the input's gradient. A row read by an int comes whole on every rank (replicated); a write
puts a whole value, broadcast along the block dims it slices, into each rank's part of the region. What has no rule
is refused by name on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import assert_equal_or_refused, case_error, on_blocks

D64 = torch.float64
B, C, H, W = 2, 3, 7, 6
BLOCKS = {"(4, 3) x (2, 4)": ((4, 3), (2, 4)), "(7, 0) x (5, 1)": ((7, 0), (5, 1))}


def _poles(x: torch.Tensor) -> torch.Tensor:
    """torch-harmonics' ``ResampleS2._expand_poles``: the ring's mean written into a row padded on at each pole."""
    north, south = x[..., 0, :].mean(dim=-1, keepdim=True), x[..., -1, :].mean(dim=-1, keepdim=True)
    y = F.pad(x, (0, 0, 1, 1))
    y[..., 0, :] = north
    y[..., -1, :] = south
    return y


def _writes(x: torch.Tensor) -> torch.Tensor:
    y = x * 1.0
    y[:, :, 2:5, :] = 0.5                                     # a slice of one block dim, a scalar
    y[:, 1, 3, :] = x[:, 2, 0, 1:2] * 2                       # ints on a channel and on latitude, a (B, 1) value
    y[..., 4] = torch.arange(C, dtype=D64)[:, None]           # an int on longitude, a plain (C, 1) value
    y[0, :, -1, -2] = x[1, :, 1, 0]                           # ints on both block dims: a point per channel
    return y


def _cases_body(sizes) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    x0 = torch.randn(B, C, H, W, dtype=D64, generator=torch.Generator().manual_seed(7))

    cases = {
        "row": lambda x: x[..., 0, :] * 2 + x[..., -1, :],
        "column": lambda x: x[:, :, 3] * 2 + x[..., 2].sum(-1, keepdim=True),
        "point": lambda x: x[:, 1, 4, 2] + x[:, :, -1, -1].sum(1),
        "poles": _poles,
        "writes": _writes,
        "a value along a sliced block dim": lambda x: x.clone().__setitem__((0, 0, slice(None), 1), x[1, 1, :, 1]),
        "a tensor index": lambda x: x.clone().__setitem__((0, 0, torch.tensor([1, 2])), 1.0),
    }
    errors = {name: case_error(on_blocks(fn, sizes), x0, i) if "value along" not in name and "tensor index" not in name
              else _refused(fn, domain.shard(x0.clone(), dims=(2, 3), sizes=sizes)) for i, (name, fn) in enumerate(cases.items())}
    DistributedManager.shutdown()
    return errors


def _refused(fn, xs) -> float | str:
    try:
        fn(xs)
    except NotImplementedError as refusal:
        return str(refusal).split(":")[0]
    return 0.0


@pytest.mark.parametrize("layout", list(BLOCKS))
def test_rows_read_by_an_int_and_writes_into_blocks_equal_one_process_or_are_refused_by_name(ranks, layout):
    for errors in ranks.run(4, _cases_body, BLOCKS[layout]):
        assert_equal_or_refused(errors, {"a value along a sliced block dim": "torch.Tensor.__setitem__ into blocks",
                                         "a tensor index": "torch.Tensor.__setitem__ with tensor("}, 1e-12)
