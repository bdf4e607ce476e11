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
import faulthandler
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import safetensors.torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mesh3d import DistributedManager, checkpoint  # noqa: E402
from mesh3d._torch_private import clear_dtensor_caches  # noqa: E402
from mesh3d.checkpoint.chunks import local_data  # noqa: E402
from bench_checkpoint_async import REPEATS, WORLD, async_phases, build_state, first_calls, state_model, write_async_report  # noqa: E402,E501


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


def _rank_main(rank: int, port: int, args: argparse.Namespace, work: str, results: str) -> None:
    torch.set_num_threads(1)
    # Our own default group outlives DistributedManager.shutdown() between the two meshes.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hung phase prints stacks instead of hanging
    out: dict[str, float] = {}
    model = build_state((WORLD, 1, 1), args)
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
    async_phases(model, work, rm, out, args.async_repeats)
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
    clear_dtensor_caches()
    hsdp = build_state((2, 2, 1), args)
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
        out.update(first_calls(args, work))
        write_async_report(out, args)
        if args.async_only:
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", _COALESCE, f"{work}/m3-{REPEATS - 1}", f"{work}/hf"], capture_output=True,
                              text=True, env=env, check=True)
        co = json.loads(proc.stdout)
        largest = max(t.numel() * t.element_size() for t in state_model(args.layer_mb, args.layer_mb).state_dict().values())
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
