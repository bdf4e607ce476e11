"""The ``dispatch`` part of ``scripts/bench_domain.py``: the host cost of one op on a tiny tensor, per contender.

Usage (bench_domain.py calls it)::

    report["dispatch"] = part_dispatch(args, torch.device("cpu"))

Each op of ``dispatch_ops`` runs ``args.dispatch_calls`` times in a loop on a 1x2x4x4 tensor, one thread: plain torch,
the wrapper-subclass domain tensor at domain=1 as it runs (the default kind since issue 64; ``wrapper_us``: calls whose
signature was seen answered from what was kept, ``dispatch.kept``), the same tensor with kept answers off so every
call takes the dispatcher's walk and its rule (``full_dispatcher_us``), the storage-subclass domain tensor (private,
``MESH3D_DOMAIN_WRAPPER=0``; ``domain_us``, ``overhead_us`` its cost over plain torch: the walk on every call since issue
66 took its short path away), and a DTensor sharded the same way on a one-rank gloo mesh (``dtensor_us``; None where
DTensor refuses the op). The contenders take turns, round by round (``args.dispatch_rounds``), and each keeps its best
round's median: the machine may be shared, and the best round is the least disturbed one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mesh3d import domain
from mesh3d.domain.comm.divergence import OpJournal
from mesh3d.domain.core.wrapped import wrapper_tensors
from mesh3d.domain.dispatch.kept import KEPT

__all__ = ["dispatch_ops", "part_dispatch", "plot_dispatch"]


def dispatch_ops(w: torch.Tensor, gn_weight: torch.Tensor, gn_bias: torch.Tensor) -> dict[str, Callable]:
    """The ops timed, on tensors of one kind (the weights are of that kind too: DTensor wants them distributed)."""
    return {
        "add": lambda t: t + 1.0,
        "relu": torch.relu,
        "mul (two tensors)": lambda t: t * t,
        "conv2d": lambda t: F.conv2d(t, w, padding=1),
        "group_norm": lambda t: F.group_norm(t, 1, gn_weight, gn_bias),
        "max_pool2d": lambda t: F.max_pool2d(t, 2),
        "sum": lambda t: t.sum(),
        "reshape": lambda t: t.reshape(1, 2, -1),
    }


def _per_call(fn: Callable, t: torch.Tensor, n: int) -> float:
    """The median of 3 timed loops of ``n`` calls, per call, in seconds (after one warm-up loop)."""
    def loop() -> None:
        for _ in range(n):
            fn(t)

    loop()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        loop()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


def _dtensor_contender(x: torch.Tensor, w: torch.Tensor, gn: tuple[torch.Tensor, torch.Tensor]):
    """(ops, the input) as DTensors on a one-rank gloo mesh, sharded along dim 2 like the domain tensor; None where a
    process group exists already (the benchmark does not replace it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized() or not dist.is_available():
        return None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(x.device.type, (1,))
    rep = lambda t: distribute_tensor(t, mesh, [Replicate()])  # noqa: E731
    return dispatch_ops(rep(w), rep(gn[0]), rep(gn[1])), distribute_tensor(x, mesh, [Shard(2)])


def part_dispatch(args, device) -> dict:
    """Per-op host cost of each contender (module docstring), the divergence journal's cost per entry and the Python
    time of ``full_tensor`` on 10^6 rows."""
    x = torch.randn(1, 2, 4, 4, device=device)
    w = torch.randn(2, 2, 3, 3, device=device)
    gn = (torch.randn(2, device=device), torch.randn(2, device=device))
    with wrapper_tensors(False):  # NOTE: the storage subclass, whichever kind is the default
        xs = domain.shard(x, dim=2)
    with wrapper_tensors():
        xw = domain.shard(x, dim=2)
    ops = dispatch_ops(w, *gn)
    dt = _dtensor_contender(x, w, gn)
    n, rounds = args.dispatch_calls, getattr(args, "dispatch_rounds", 5)
    out = {}
    try:
        for name, fn in ops.items():
            best = {"plain": float("inf"), "domain": float("inf"), "full": float("inf"), "dtensor": float("inf"),
                    "wrapper": float("inf")}
            for _ in range(rounds):
                best["plain"] = min(best["plain"], _per_call(fn, x, n))
                with wrapper_tensors(False):
                    best["domain"] = min(best["domain"], _per_call(fn, xs, n))
                with wrapper_tensors():
                    best["wrapper"] = min(best["wrapper"], _per_call(fn, xw, n))
                    with KEPT.off():
                        best["full"] = min(best["full"], _per_call(fn, xw, n))
                if dt is not None and best["dtensor"] is not None:
                    try:
                        best["dtensor"] = min(best["dtensor"], _per_call(dt[0][name], dt[1], n))
                    except Exception:  # noqa: BLE001 - DTensor has no rule for it: no figure
                        best["dtensor"] = None
            us = {k: None if v is None or v == float("inf") else v * 1e6 for k, v in best.items()}
            out[name] = {"plain_us": us["plain"], "domain_us": us["domain"], "overhead_us": us["domain"] - us["plain"],
                         "full_dispatcher_us": us["full"], "dtensor_us": us["dtensor"], "wrapper_us": us["wrapper"]}
            dtensor = "-" if us["dtensor"] is None else f"{us['dtensor']:.1f}"
            print(f"  {name:20s} plain {us['plain']:5.1f} us, wrapper {us['wrapper']:5.1f} us (kept answers off: "
                  f"{us['full']:.1f}), storage subclass {us['domain']:.1f} us, DTensor {dtensor} us", flush=True)
    finally:
        if dt is not None:
            dist.destroy_process_group()
    # On a multi-rank domain each layout-changing op is also journaled (for divergence detection):
    # its cost per op, measured on the journal itself (a one-rank domain does not journal).
    journal = OpJournal()
    record = lambda _: journal.record("torch.nn.functional.conv2d", (2, 512))  # noqa: E731
    per = min(_per_call(record, x, n) for _ in range(3))
    out["journal record (multi-rank only)"] = {"us": per * 1e6}
    print(f"  journal record (multi-rank domains): +{per * 1e6:.1f} us per layout-changing op", flush=True)
    big = domain.shard(torch.zeros(10**6, 1), dim=0)
    whole = min(_per_call(lambda t: t.full_tensor(), big, 1) for _ in range(5))
    copy = min(_per_call(lambda t: t.to_local().clone(), big, 1) for _ in range(5))
    out["full_tensor 1e6 rows"] = {"total_ms": whole * 1e3, "copy_ms": copy * 1e3,
                                   "python_ms": max(whole - copy, 0.0) * 1e3}
    print(f"  full_tensor 1e6 rows: {whole * 1e3:.3f} ms (a plain copy of the shard: {copy * 1e3:.3f} ms)", flush=True)
    return out


def plot_dispatch(ax, dispatch: dict) -> None:
    """Bars of each op's host cost per contender on ``ax`` (a matplotlib axis), with the goals as lines."""
    ops = {k: v for k, v in dispatch.items() if "full_dispatcher_us" in v}
    names = list(ops)
    kinds = (("plain_us", "plain torch"), ("wrapper_us", "domain tensor (kept answers)"),
             ("full_dispatcher_us", "domain tensor, every call its rule"), ("dtensor_us", "DTensor"),
             ("domain_us", "storage subclass (private)"))
    for i, (key, label) in enumerate(kinds):
        ax.barh([j + (i - 2) * 0.16 for j in range(len(names))], [ops[n].get(key) or 0.0 for n in names],
                height=0.16, label=label)
    ax.set_yticks(range(len(names)), names)
    ax.axvline(8, color="red", linestyle="--", label="goal 8 us over plain (element-wise, view; bars: the whole call)")
    ax.axvline(12, color="purple", linestyle=":", label="goal 12 us over plain (conv)")
    ax.set_xlabel("us per call, 1x2x4x4 tensor, one thread")
    ax.legend(loc="lower right", fontsize=7)
