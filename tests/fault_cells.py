"""The fault-injection cells shared by tests/faults/ and scripts/bench_faults.py: one rank is killed, raises or
hangs at one point of a training step (forward, backward, a halo exchange, an FSDP all-gather, a checkpoint save
or load); every other rank reports what it raised and how long after the fault it learnt of it.

The step: three ranks (batch 1, domain 3), a conv stack with FSDP over batch x domain and its input sharded in
slabs, inside ``dm.guard``. The fault time is read from the job's store (the victim writes it just before the
fault), so each survivor's latency is measured on one clock, the host's.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mesh3d import DistributedManager, Plan, WatchSettings, checkpoint, domain, parallelize
from mesh3d._torch_private import default_store
from mesh3d.domain import exchange

POINTS = ("forward", "backward", "halo", "fsdp", "save", "load")
ACTIONS = ("kill", "raise", "hang")
#: Short settings so a cell ends in seconds: the group timeout bounds a hang, the watch a loss.
GROUP_TIMEOUT_S = 6.0
WATCH = {"interval": 0.25, "suspect_after": 1.0, "dead_after": 4.0, "grace": 2.0}
VICTIM = 1
SLABS = (4, 4, 4)  # rows of the 12-row field on each domain rank


#: What FSDP2 calls to all-gather a unit's parameters (torch 2.13: ``all_gather_single``; before: into_tensor).
FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class InjectedFault(RuntimeError):
    """What a ``raise`` cell's victim raises."""


def _fault(action: str, key: str) -> None:
    default_store().set(key, repr(time.time()))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault("injected fault")
    time.sleep(GROUP_TIMEOUT_S + 6.0)  # a hang that outlasts the survivors' group timeout
    raise InjectedFault("woke up after the hang")


class _GradTap(torch.autograd.Function):
    """Identity whose backward calls ``at_backward`` (a fault in the middle of the backward pass)."""

    @staticmethod
    def forward(ctx, x, at_backward):
        ctx.at_backward = at_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.at_backward()
        return grad, None


class _Tap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.at_forward: Callable[[], None] | None = None
        self.at_backward: Callable[[], None] | None = None

    def forward(self, x):
        if self.at_forward is not None:
            self.at_forward()
        if self.at_backward is not None:
            local = _GradTap.apply(x.to_local(), self.at_backward)
            return domain.from_local(local, dim=2, sizes=SLABS)
        return x


def _once(fn: Callable[[], None], after: int = 0) -> Callable[..., None]:
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            fn()
    return wrapped


def fault_cell_body(point: str, action: str, root: str, tag: str) -> dict:
    """One cell on one rank; returns what this rank raised and the seconds from the fault to it."""
    dm = DistributedManager.initialize(batch=1, domain=-1, timeout=GROUP_TIMEOUT_S, watch=WatchSettings(**WATCH))
    key = f"fault_cells/{tag}"
    torch.manual_seed(0)
    tap = _Tap()
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), tap, nn.Conv2d(4, 1, 3, padding=1))
    net = parallelize(net, Plan(batch="fsdp", units=["0", "1", "3"]))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = domain.shard(torch.randn(1, 1, sum(SLABS), 6), dim=2, sizes=SLABS)
    ckpt = os.path.join(root, f"{tag}-ckpt")
    victim = dm.rank == VICTIM
    fault = _once(lambda: _fault(action, key))
    restore = []
    if victim and point == "forward":
        tap.at_forward = fault
    if victim and point == "backward":
        tap.at_backward = fault
    if victim and point == "halo":
        real = exchange.start_exchange
        exchange.start_exchange = lambda *a, **k: (fault(), real(*a, **k))[1]
        restore.append(lambda: setattr(exchange, "start_exchange", real))
    if victim and point == "fsdp":
        name = FSDP_ALL_GATHER
        real_ag = getattr(dist, name)
        on_second = _once(lambda: _fault(action, key), after=1)  # the second unit's all-gather: mid-forward
        setattr(dist, name, lambda *a, **k: (on_second(), real_ag(*a, **k))[1])
        restore.append(lambda: setattr(dist, name, real_ag))
    if point == "load":
        checkpoint.save(ckpt, net, opt, step=0)
    started = time.time()
    try:
        with dm.guard(f"cell {point}/{action}"):
            if point == "save":
                checkpoint.save(ckpt, net, opt, step=1,
                                stage_hook=(lambda s: fault() if s == "mid_shard" else None) if victim else None)
            elif point == "load":
                if victim:
                    fault()
                checkpoint.load(ckpt, net, opt)
            else:
                for _ in range(2):
                    net(xs).square().sum().backward()
                    opt.step()
                    opt.zero_grad()
        return {"rank": dm.rank, "error": None, "message": "", "seconds": time.time() - started}
    except Exception as err:  # the cell's outcome, reported to the test
        faulted = float(default_store().get(key)) if default_store().check([key]) else started
        return {"rank": dm.rank, "error": type(err).__name__, "message": str(err),
                "seconds": round(time.time() - faulted, 3)}
    finally:
        for undo in restore:
            undo()
