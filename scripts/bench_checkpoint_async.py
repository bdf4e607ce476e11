"""The save-without-stopping part of ``scripts/bench_checkpoint.py``, and the FSDP state both parts save.

How long the training loop is blocked by ``checkpoint.async_save`` against DCP's ``async_save`` (its default stager
made per call, and one stager kept across saves) and against the floor under any background save (copying the
bytes once): steady state in rounds where the contenders take turns, the first call in fresh jobs.

Usage (bench_checkpoint.py's ranks call these)::

    model = build_state((WORLD, 1, 1), args)      # the manager and the FSDP-sharded Linear stack
    async_phases(model, work, rm, out, repeats)   # steady state, every contender and the copy floor
    out.update(first_calls(args, work))           # each contender's first call, in fresh jobs
    write_async_report(out, args)                 # checkpoint_async.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

from mesh3d import DistributedManager, checkpoint
from mesh3d.checkpoint.chunks import local_data

__all__ = ["REPEATS", "WORLD", "async_phases", "build_state", "first_calls", "state_model", "write_async_report"]

WORLD = 4


def state_model(size_mb: int, layer_mb: int) -> torch.nn.Module:
    rows = layer_mb * 1024 * 1024 // 4 // 1024
    n_layers = max(1, size_mb // layer_mb)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, rows, bias=True) for _ in range(n_layers)])


REPEATS = 3  # the synchronous phases: best of three


def _timed_async(start, finish, cleanup, label: str, repeats: int) -> tuple[float, float, float]:
    """Best of ``repeats`` of (seconds the caller is blocked, seconds until durable), slowest rank each, and the first
    run's blocked seconds (it pays the one-time costs: buffers, groups, plans)."""
    blocked, total, first = float("inf"), float("inf"), None
    for i in range(repeats):
        times = _one_async(start, finish, i)
        blocked, total = min(blocked, times[0]), min(total, times[1])
        first = times[0] if first is None else first
        if i < repeats - 1:
            cleanup(i)
            dist.barrier()
    if dist.get_rank() == 0:
        print(f"  {label:<32} best of {repeats}: blocked {blocked:.3f} s (first call {first:.3f} s), durable after "
              f"{total:.3f} s", flush=True)
    return blocked, total, first


def _copy_floor(model, out: dict[str, float], repeats: int) -> None:
    """The floor under any background save's blocking time: copying this rank's bytes into a reused buffer
    (torch ``copy_``, and the C library's ``memmove`` that mesh3d's snapshot uses), slowest rank, best of 3."""
    sources = [local_data(t).detach() for t in get_model_state_dict(model).values()]
    sizes = [t.numel() * t.element_size() for t in sources]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)  # touched once here: no page faults when timed
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    views = [buffer[b : b + n].view(t.dtype).view(t.shape) for t, b, n in zip(sources, starts, sizes)]

    def torch_copy(i):
        for view, t in zip(views, sources):
            view.copy_(t)

    def memmove(i):
        for view, t, n in zip(views, sources, sizes):
            ctypes.memmove(view.data_ptr(), t.data_ptr(), n)

    out["copy_floor_torch"], _, _ = _timed_async(torch_copy, lambda _: None, lambda i: None, "copy_floor_torch", repeats)
    out["copy_floor_memmove"], _, _ = _timed_async(memmove, lambda _: None, lambda i: None, "copy_floor_memmove", repeats)


def async_phases(model, work: str, rm, out: dict[str, float], repeats: int) -> None:
    """The loop-blocking time of a background save: mesh3d vs DCP (two stager set-ups), and the copy floor.

    NOTE: the contenders take turns, one save each per round, each first in a round as often as the others: run as
    one phase after another, whichever ran while the machine's other load was lighter would win. Each contender's
    first save here is left out of its steady-state figures (it pays one-time costs, timed in fresh jobs instead)."""
    _copy_floor(model, out, repeats)
    group = dist.new_group(backend="gloo")  # DCP's background collectives must not share the loop's group
    stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU: synchronous staging, cached copy
    contenders = _async_contenders(model, work, group, stager)
    names = list(contenders)
    blocked: dict[str, list[float]] = {name: [] for name in names}
    durable: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats + 1):  # round 0 warms every contender up
        for name in names[i % len(names):] + names[: i % len(names)]:
            start, finish = contenders[name]
            times = _one_async(start, finish, f"{name}-{i}")
            rm(f"{work}/{{}}")(f"{name}-{i}")
            dist.barrier()
            if i:
                blocked[name].append(times[0])
                durable[name].append(times[1])
    for name in names:
        out[f"async_block_{name}"], out[f"async_durable_{name}"] = min(blocked[name]), min(durable[name])
        out[f"async_block_median_{name}"] = statistics.median(blocked[name])
        out[f"async_durable_median_{name}"] = statistics.median(durable[name])
        if dist.get_rank() == 0:
            print(f"  async_save_{name:<21} {repeats} rounds: blocked best {min(blocked[name]):.3f} s, median "
                  f"{statistics.median(blocked[name]):.3f} s; durable after {min(durable[name]):.3f} s "
                  f"(median {statistics.median(durable[name]):.3f} s)", flush=True)
    stager.close()


def _one_async(start, finish, tag: Any) -> tuple[float, float]:
    """(seconds the caller is blocked, seconds until durable) of one background save, slowest rank each."""
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    pending = start(tag)
    t1 = time.perf_counter()
    finish(pending)
    dist.barrier()
    times = torch.tensor([t1 - t0, time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times[0]), float(times[1])


def _async_contenders(model, work: str, group, stager) -> dict:
    """name: (start(i), finish(pending)) of each background save."""
    return {
        "mesh3d": (lambda tag: checkpoint.async_save(f"{work}/{tag}", model, step=1), lambda h: h.wait()),
        "dcp": (lambda tag: dcp.async_save(get_model_state_dict(model), checkpoint_id=f"{work}/{tag}",
                                           process_group=group), lambda f: f.result()),
        "dcp_kept_stager": (lambda tag: dcp.async_save(get_model_state_dict(model), checkpoint_id=f"{work}/{tag}",
                                                       process_group=group, async_stager=stager), lambda f: f.result()),
    }


def build_state(shape: tuple[int, int, int], args: argparse.Namespace) -> torch.nn.Module:
    """The manager started on ``shape`` and the FSDP-sharded Linear stack (seed 0)."""
    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    model = state_model(args.size_mb, args.layer_mb)
    mesh = dm.batch_domain_mesh if shape[1] == 1 else dm.mesh["batch", "domain"]
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _first_call_rank(rank: int, port: int, args: argparse.Namespace, work: str, results: str, name: str) -> None:
    """A fresh job: the model built and trained two steps, then ``name``'s first background save, timed.

    NOTE: each contender's first call runs in its own fresh processes, after the same history. Timed one after
    another in one process, a later contender finds pages an earlier one freed still on glibc's heap (its mmap
    threshold adapts to freed 16 MB chunks) and skips most page faults: the order, not the contender, decided."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = build_state((WORLD, 1, 1), args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(8, 1024)
        sum(layer(x).square().mean() for layer in model).backward()  # the layers do not chain: each sees x
        opt.step()
        opt.zero_grad()
    group = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, False, False, False))
    start, finish = _async_contenders(model, work, group, stager)[name]
    _, _, first = _timed_async(lambda i: start(f"first-{i}"), finish, lambda i: None, f"first_{name}", 1)
    stager.close()
    DistributedManager.shutdown()
    if rank == 0:
        with open(results, "w") as f:
            json.dump({f"async_first_block_{name}": first}, f)
    dist.destroy_process_group()


def first_calls(args: argparse.Namespace, work: str) -> dict[str, float]:
    """Every contender's first background save, each in ``args.first_jobs`` fresh jobs (``_first_call_rank``), the
    contenders taking turns; the median job per contender, and every job's time."""
    times: dict[str, list[float]] = {}
    for job in range(args.first_jobs):
        for name in ("mesh3d", "dcp", "dcp_kept_stager"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            results = os.path.join(work, f"first-{name}-{job}.json")
            mp.start_processes(_first_call_rank, args=(port, args, os.path.join(work, f"first-{name}-{job}"), results,
                                                       name), nprocs=WORLD, start_method="spawn")
            times.setdefault(name, []).append(json.load(open(results))[f"async_first_block_{name}"])
    out: dict[str, float] = {}
    for name, seconds in times.items():
        out[f"async_first_block_{name}"] = statistics.median(seconds)
        out[f"async_first_block_{name}_jobs"] = seconds
    return out


def write_async_report(out: dict[str, float], args: argparse.Namespace) -> None:
    """checkpoint_async.json: blocking and durable times, and the ratios the issue's goals are stated in."""
    best_dcp = min(out["async_block_dcp"], out["async_block_dcp_kept_stager"])
    report = {
        "config": {"ranks": WORLD, "state_bytes": out["state_bytes"], "layer_mb": args.layer_mb,
                   "size_mb_flag": args.size_mb, "torch": torch.__version__, "cpu_count": os.cpu_count(),
                   "note": f"gloo on CPU; {args.async_repeats} rounds with the contenders taking turns, best and median "
                           f"(sync save: best of {REPEATS}); blocked = call to return, slowest rank; every save fsynced",
                   "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]},
        "seconds": {k: v for k, v in out.items() if k.startswith(("async_", "save_mesh3d", "copy_floor"))
                    and not k.endswith("_jobs")},
        "first_call_jobs_seconds": {k.removeprefix("async_first_block_").removesuffix("_jobs"): v
                                    for k, v in out.items() if k.endswith("_jobs")},
        "ratios": {
            "async_block_vs_sync_save": out["async_block_mesh3d"] / out["save_mesh3d"],  # goal <= 0.2
            "async_block_vs_best_dcp_async_block": out["async_block_mesh3d"] / best_dcp,  # goal <= 1
            "async_block_median_vs_best_dcp_median": out["async_block_median_mesh3d"] / min(  # goal <= 1
                out["async_block_median_dcp"], out["async_block_median_dcp_kept_stager"]),
            "async_first_block_vs_best_dcp_first_block": out["async_first_block_mesh3d"] / min(  # goal <= 1
                out["async_first_block_dcp"], out["async_first_block_dcp_kept_stager"]),
            "copy_floor_torch_vs_sync_save": out["copy_floor_torch"] / out["save_mesh3d"],
            "copy_floor_memmove_vs_sync_save": out["copy_floor_memmove"] / out["save_mesh3d"],
            "async_durable_vs_dcp_async_durable": out["async_durable_mesh3d"] / min(
                out["async_durable_dcp"], out["async_durable_dcp_kept_stager"]),
        },
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.async_json), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
