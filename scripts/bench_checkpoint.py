#!/usr/bin/env python
"""Benchmark mesh3d checkpoints against torch.distributed.checkpoint and raw safetensors.

Four gloo ranks hold an FSDP-sharded stack of fp32 Linear layers (``--size-mb`` of model
state). In one run, with barriers around each timed phase (wall = slowest rank):

- save: mesh3d (fsynced, atomic) vs DCP ``dcp.save`` (FileSystemWriter, sync_files) vs
  ``safetensors.torch.save_file`` of each rank's local shards (+ fsync) vs a durable
  disk-write ceiling (os.write of the same bytes + fsync);
- load (the in-place default, and all-or-nothing ``in_place=False``) on the same mesh, and resharded onto HSDP (2 x 2: each rank needs half of every
  tensor): mesh3d vs DCP (``dcp.load`` + ``set_model_state_dict``), plus mesh3d's read
  amplification (bytes read / bytes needed, summed over ranks);
- coalesce to one HF ``model.safetensors`` in a fresh process: throughput and peak RSS
  (ru_maxrss minus the RSS after imports);
- saving without stopping (also alone with ``--async-only``; written to ``checkpoint_async.json``):
  how long the training loop is blocked by ``checkpoint.async_save`` (call to return, slowest rank)
  vs DCP ``async_save`` (thread executor, a separate gloo group; its default stager made per call,
  and one stager kept across saves so it reuses its CPU copy) vs mesh3d's synchronous ``save``,
  plus each one's time until the checkpoint is durable. Each contender's *first* call is timed in fresh jobs
  (``--first-jobs``, the contenders taking turns), after the same two training steps: timed in one process, a
  later contender would find memory an earlier one freed.

Reads hit the page cache (the box has more RAM than the checkpoint, and dropping caches
needs root): load figures are warm-cache. Writes are fsynced in every contender.

Usage::

    python scripts/bench_checkpoint.py --size-mb 1024          # the issue's >= 1 GB run
    python scripts/bench_checkpoint.py --size-mb 256 --out docs/benchmarks
    python scripts/bench_checkpoint.py --size-mb 1024 --async-only  # only the save-without-stopping phases
    python scripts/bench_checkpoint.py --async-only --async-repeats 31  # more rounds on a noisy machine
    python scripts/bench_checkpoint.py --size-mb 256 --async-only --async-json checkpoint_async_256mb.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _model(size_mb: int, layer_mb: int) -> torch.nn.Module:
    rows = layer_mb * 1024 * 1024 // 4 // 1024
    n_layers = max(1, size_mb // layer_mb)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, rows, bias=True) for _ in range(n_layers)])


REPEATS = 3


def _timed(fn, cleanup=None, label: str = "") -> float:
    """Best of REPEATS (first calls pay one-time costs: imports, DTensor dispatch caches)."""
    best = float("inf")
    for i in range(REPEATS):
        os.sync()  # start each run with no dirty pages left by the previous contender's writes
        dist.barrier()
        start = time.perf_counter()
        fn(i)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
        if cleanup is not None and i < REPEATS - 1:
            cleanup(i)
            dist.barrier()
    if label and dist.get_rank() == 0:  # progress: one line per contender
        print(f"  {label:<32} best of {REPEATS}: {best:.3f} s", flush=True)
    return best


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
    import ctypes

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mesh3d.checkpoint.chunks import local_data

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


def _async_phases(model, work: str, rm, out: dict[str, float], repeats: int) -> None:
    """The loop-blocking time of a background save: mesh3d vs DCP (two stager set-ups), and the copy floor.

    NOTE: the contenders take turns, one save each per round, each first in a round as often as the others: run as
    one phase after another, whichever ran while the machine's other load was lighter would win. Each contender's
    first save here is left out of its steady-state figures (it pays one-time costs, timed in fresh jobs instead)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mesh3d import checkpoint

    return {
        "mesh3d": (lambda tag: checkpoint.async_save(f"{work}/{tag}", model, step=1), lambda h: h.wait()),
        "dcp": (lambda tag: dcp.async_save(get_model_state_dict(model), checkpoint_id=f"{work}/{tag}",
                                           process_group=group), lambda f: f.result()),
        "dcp_kept_stager": (lambda tag: dcp.async_save(get_model_state_dict(model), checkpoint_id=f"{work}/{tag}",
                                                       process_group=group, async_stager=stager), lambda f: f.result()),
    }


def _build(shape: tuple[int, int, int], args: argparse.Namespace) -> torch.nn.Module:
    """The manager started on ``shape`` and the FSDP-sharded Linear stack (seed 0)."""
    from torch.distributed.fsdp import fully_shard

    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    model = _model(args.size_mb, args.layer_mb)
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
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from mesh3d import DistributedManager

    model = _build((WORLD, 1, 1), args)
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


def _first_calls(args: argparse.Namespace, work: str) -> dict[str, float]:
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


def _rank_main(rank: int, port: int, args: argparse.Namespace, work: str, results: str) -> None:
    torch.set_num_threads(1)
    # Our own default group outlives DistributedManager.shutdown() between the two meshes.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import faulthandler

    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hung phase prints stacks instead of hanging
    import torch.distributed.checkpoint as dcp
    import safetensors.torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from mesh3d import DistributedManager, checkpoint
    from mesh3d.checkpoint.chunks import local_data

    out: dict[str, float] = {}
    model = _build((WORLD, 1, 1), args)
    sd = get_model_state_dict(model)
    local = {k: local_data(v).contiguous() for k, v in sd.items()}
    my_bytes = sum(t.numel() * t.element_size() for t in local.values())
    total = torch.tensor([my_bytes], dtype=torch.int64)
    dist.all_reduce(total)
    out["state_bytes"] = int(total.item())

    def rm(path):
        return lambda i: shutil.rmtree(path.format(i), ignore_errors=True) if rank == 0 else None

    # The last repeat's directory (index 2) is kept and used by the loads below.
    out["save_mesh3d"] = _timed(label="save_mesh3d", fn=lambda i: checkpoint.save(f"{work}/m3-{i}", model, step=1), cleanup=rm(f"{work}/m3-{{}}"))
    _async_phases(model, work, rm, out, args.async_repeats)
    if args.async_only:
        DistributedManager.shutdown()
        if rank == 0:
            with open(results, "w") as f:
                json.dump(out, f)
        dist.destroy_process_group()
        return
    out["save_dcp"] = _timed(label="save_dcp", fn=lambda i: dcp.save(get_model_state_dict(model), checkpoint_id=f"{work}/dcp-{i}"),
                             cleanup=rm(f"{work}/dcp-{{}}"))

    def raw_st(i):
        path = f"{work}/raw/rank{rank}-{i}.safetensors"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        safetensors.torch.save_file(local, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out["save_safetensors_raw"] = _timed(label="save_safetensors_raw", fn=raw_st)
    block = bytearray(8 * 1024 * 1024)

    def ceiling(i):
        path = f"{work}/ceiling-{rank}-{i}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        left = my_bytes
        while left > 0:
            left -= os.write(fd, memoryview(block)[: min(left, len(block))])
        os.fsync(fd)
        os.close(fd)

    out["save_disk_ceiling"] = _timed(label="save_disk_ceiling", fn=ceiling)

    info = {}
    last = REPEATS - 1
    out["load_mesh3d"] = _timed(label="load_mesh3d", fn=lambda i: info.update(i=checkpoint.load(f"{work}/m3-{last}", model)))
    out["load_mesh3d_all_or_nothing"] = _timed(label="load_mesh3d_all_or_nothing", fn=lambda i: checkpoint.load(f"{work}/m3-{last}", model, in_place=False))

    if os.environ.get("BENCH_PROFILE") and rank == 0:  # where does a mesh3d load spend its time?
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(checkpoint.load, f"{work}/m3-{last}", model)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(12)
    elif os.environ.get("BENCH_PROFILE"):
        checkpoint.load(f"{work}/m3-{last}", model)

    def dcp_load(m):
        state = get_model_state_dict(m)
        dcp.load(state, checkpoint_id=f"{work}/dcp-{last}")
        set_model_state_dict(m, state)

    out["load_dcp"] = _timed(label="load_dcp", fn=lambda i: dcp_load(model))
    del model, sd, local
    DistributedManager.shutdown()
    from mesh3d._torch_private import clear_dtensor_caches

    clear_dtensor_caches()
    hsdp = _build((2, 2, 1), args)
    out["reshard_load_mesh3d"] = _timed(label="reshard_load_mesh3d", fn=lambda i: info.update(r=checkpoint.load(f"{work}/m3-{last}", hsdp)))
    out["reshard_load_mesh3d_all_or_nothing"] = _timed(label="reshard_load_mesh3d_all_or_nothing", fn=lambda i: checkpoint.load(f"{work}/m3-{last}", hsdp, in_place=False))
    out["reshard_load_dcp"] = _timed(label="reshard_load_dcp", fn=lambda i: dcp_load(hsdp))
    io = torch.tensor([info["r"].bytes_read, info["r"].bytes_needed], dtype=torch.int64)
    dist.all_reduce(io)
    out["reshard_bytes_read"], out["reshard_bytes_needed"] = int(io[0]), int(io[1])
    same = torch.tensor([info["i"].bytes_read, info["i"].bytes_needed], dtype=torch.int64)
    dist.all_reduce(same)
    out["same_mesh_bytes_read"], out["same_mesh_bytes_needed"] = int(same[0]), int(same[1])
    DistributedManager.shutdown()
    if rank == 0:
        with open(results, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def _write_async_report(out: dict[str, float], args: argparse.Namespace) -> None:
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


_COALESCE = r"""
import json, os, resource, sys, time
from mesh3d import checkpoint
def rss_kb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
base = rss_kb()
start = time.perf_counter()
checkpoint.coalesce(sys.argv[1], sys.argv[2])
secs = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": secs, "peak_rss_mb": peak / 1024, "rss_after_imports_mb": base / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="model state size (MB of fp32 weights)")
    parser.add_argument("--layer-mb", type=int, default=64, help="size of each Linear weight (MB)")
    parser.add_argument("--out", default="docs/benchmarks", help="where checkpoint.json / .png go")
    parser.add_argument("--hang-s", type=float, default=300, help="dump stacks and exit if a rank runs this long")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--async-only", action="store_true", help="only mesh3d's sync save and the async phases")
    parser.add_argument("--async-json", default="checkpoint_async.json", help="file name of the async report")
    parser.add_argument("--async-repeats", type=int, default=15, help="rounds of background saves (each contender once)")
    parser.add_argument("--first-jobs", type=int, default=3, help="fresh jobs timing each contender's first async save")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.workdir)
    results = os.path.join(work, "results.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_rank_main, args=(port, args, work, results), nprocs=WORLD, start_method="spawn")
        out = json.load(open(results))
        out.update(_first_calls(args, work))
        _write_async_report(out, args)
        if args.async_only:
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", _COALESCE, f"{work}/m3-{REPEATS - 1}", f"{work}/hf"], capture_output=True,
                              text=True, env=env, check=True)
        co = json.loads(proc.stdout)
        largest = max(t.numel() * t.element_size() for t in _model(args.layer_mb, args.layer_mb).state_dict().values())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = out["state_bytes"] / 1e9
    report = {
        "config": {"ranks": WORLD, "state_bytes": out["state_bytes"], "layer_mb": args.layer_mb,
                   "size_mb_flag": args.size_mb, "torch": torch.__version__, "cpu_count": os.cpu_count(),
                   "note": "gloo on CPU; reads are warm page cache; every save is fsynced"},
        "seconds": {k: v for k, v in out.items() if k.startswith(("save_", "load_", "reshard_load"))},
        "throughput_gb_s": {k: gb / v for k, v in out.items() if k.startswith(("save_", "load_", "reshard_load"))},
        "ratios": {
            "save_mesh3d_vs_dcp": out["save_dcp"] / out["save_mesh3d"],
            "save_mesh3d_vs_raw_safetensors": out["save_safetensors_raw"] / out["save_mesh3d"],
            "save_mesh3d_vs_disk_ceiling": out["save_disk_ceiling"] / out["save_mesh3d"],
            "load_mesh3d_vs_dcp_same_mesh": out["load_dcp"] / out["load_mesh3d"],
            "load_mesh3d_vs_dcp_resharded": out["reshard_load_dcp"] / out["reshard_load_mesh3d"],
            "load_mesh3d_all_or_nothing_vs_dcp_same_mesh": out["load_dcp"] / out["load_mesh3d_all_or_nothing"],
            "load_mesh3d_all_or_nothing_vs_dcp_resharded": out["reshard_load_dcp"] / out["reshard_load_mesh3d_all_or_nothing"],
        },
        "read_amplification": {
            "same_mesh": out["same_mesh_bytes_read"] / out["same_mesh_bytes_needed"],
            "resharded_fsdp4_to_hsdp2x2": out["reshard_bytes_read"] / out["reshard_bytes_needed"],
        },
        "coalesce": {"seconds": co["seconds"], "gb_s": gb / co["seconds"], "peak_rss_mb": co["peak_rss_mb"],
                     "rss_after_imports_mb": co["rss_after_imports_mb"],
                     "peak_minus_imports_mb": co["peak_rss_mb"] - co["rss_after_imports_mb"],
                     "largest_tensor_mb": largest / 2**20, "checkpoint_mb": out["state_bytes"] / 2**20},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no PNG written", file=sys.stderr)
        return
    names = list(report["throughput_gb_s"])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, [report["throughput_gb_s"][n] for n in names])
    ax.set_xlabel("GB/s (higher is better)")
    ax.set_title(f"checkpoint, {WORLD} ranks, {gb:.2f} GB FSDP state")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "checkpoint.png"), dpi=120)


if __name__ == "__main__":
    main()
