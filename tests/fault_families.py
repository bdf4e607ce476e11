"""Fault cells for the collective families tests/fault_cells.py does not reach, on a (2, 2, 1) mesh.

The victim is rank 3 (batch 1, domain 1): survivors 0 and 1 sit on the other batch row, so they learn of the fault
only through a collective that spans the batch axis, or through the watch. The step (2 iterations inside
``dm.guard``): a conv, GroupNorm (statistics over the domain), attention over the field's rows as a sharded sequence
(2 heads), a conv; FSDP on batch x domain (HSDP or DDP for their cells). Points:

* ``domain_reduce``: the domain's all-reduce (GroupNorm's statistics, then the loss), point-to-point;
* ``ring`` / ``ulysses``: attention's exchanges in those modes;
* ``reduce_scatter``: FSDP's gradient reduce-scatter; ``hsdp`` / ``ddp``: the replicas' gradient all-reduce;
* ``commit``: a checkpoint's commit (the victim faults after writing its shards); ``async``: the background writer of
  ``checkpoint.async_save`` (the victim's writer thread faults mid-shard; every rank then waits on its handle).

Each cell reuses tests/fault_cells.py's faults (kill, raise, hang), settings and outcome conventions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fault_cells import GROUP_TIMEOUT_S, WATCH, _fault, _once, check_outcome, outcome, run_cell, train_steps
from mesh3d import DistributedManager, Plan, WatchSettings, checkpoint, domain, parallelize
from mesh3d.domain.attention import collect as attention_collect, ring
from mesh3d.domain.comm import collectives

POINTS = ("domain_reduce", "ring", "ulysses", "reduce_scatter", "hsdp", "ddp", "commit", "async")
MESH = (2, 2, 1)
WORLD = 4
VICTIM = 3
VICTIM_NAME = "rank 3 (batch 1, domain 1, model 0)"
ROWS = (5, 3)  # the 8-row field's rows on each domain rank

#: What FSDP2 calls to reduce-scatter gradients (torch 2.13: ``reduce_scatter_single``; before: ``_tensor``).
FSDP_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
#: The module attribute each exchange point calls, patched on the victim: (module, name).
_PATCHED = {"domain_reduce": (collectives, "exchange_all"), "ring": (ring, "start_exchange"),
            "ulysses": (attention_collect, "start_exchange"), "reduce_scatter": (dist, FSDP_REDUCE_SCATTER),
            "hsdp": (dist, "all_reduce"), "ddp": (dist, "all_reduce")}


class FieldAttention(nn.Module):
    """Conv, GroupNorm, attention over every position of the field (2 heads, the rows a sharded sequence), conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.out = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        h = self.norm(self.conv(x))
        b, c, rows, cols = h.shape
        t = h.flatten(2).transpose(1, 2)                                  # (B, positions, C): a sharded sequence
        q = t.reshape(b, rows * cols, 2, c // 2).transpose(1, 2)          # (B, 2 heads, positions, C / 2)
        a = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, rows * cols, c)
        return self.out(h + a.transpose(1, 2).reshape(b, c, rows, cols))


def _inject(point: str, fault: Callable[[], None]) -> Callable[[], None]:
    """Make the victim fault at its first call of the point's exchange; returns the undo."""
    module, name = _PATCHED[point]
    real = getattr(module, name)
    setattr(module, name, lambda *a, **k: (fault(), real(*a, **k))[1])
    return lambda: setattr(module, name, real)


def family_cell_body(point: str, action: str, root: str, tag: str) -> dict:
    """One cell on one rank; returns what this rank raised and the seconds from the fault to it."""
    dm = DistributedManager.initialize(*MESH, timeout=GROUP_TIMEOUT_S, watch=WatchSettings(**WATCH))
    key = f"fault_families/{tag}"
    torch.manual_seed(0)
    batch = {"hsdp": "hsdp", "ddp": "ddp"}.get(point, "fsdp")
    net = parallelize(FieldAttention(), Plan(batch=batch, units=["conv", "out"]))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = domain.shard(torch.randn(1, 1, sum(ROWS), 3), dim=2, sizes=ROWS)
    victim = dm.rank == VICTIM
    fault = _once(lambda: _fault(action, key))
    undo = _inject(point, fault) if victim and point in _PATCHED else None
    hook = (lambda stage: fault() if stage == ("mid_shard" if point == "async" else "shards_written") else None) \
        if victim else None
    started = time.time()
    try:
        with dm.guard(f"cell {point}/{action}"), domain.attention_mode(point if point in ("ring", "ulysses") else "gather"):
            if point == "commit":
                checkpoint.save(os.path.join(root, f"{tag}-ckpt"), net, opt, step=1, stage_hook=hook)
            elif point == "async":
                checkpoint.async_save(os.path.join(root, f"{tag}-ckpt"), net, opt, step=1, stage_hook=hook).wait()
            else:
                train_steps(net, opt, xs)
        return outcome(dm.rank, key, started, None)
    except Exception as err:  # the cell's outcome, reported to the test
        return outcome(dm.rank, key, started, err)
    finally:
        if undo is not None:
            undo()


def run_family_cell(run: Callable[..., list], root: str, point: str, action: str, tag: str) -> dict[int, dict]:
    """Every survivor's outcome (as ``fault_cells.run_cell``'s), ``run`` running ``fn`` on four ranks."""
    return run_cell(run, root, point, action, tag, family_cell_body, WORLD, VICTIM)


def check_family_outcome(rank: int, out: dict, action: str) -> None:
    """A survivor's outcome names the victim, rank 3 (batch 1, domain 1, model 0)."""
    check_outcome(rank, out, action, victim=VICTIM, name=VICTIM_NAME)
