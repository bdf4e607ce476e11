#!/usr/bin/env python
"""Benchmark ``checkpoint.load_pretrained`` against DCP's ``HuggingFaceStorageReader`` on the same file.

A Hugging Face style folder holds one ``model.safetensors`` (``--size-mb`` of fp32 Linear layers;
a second folder holds the same weights in bf16). Four gloo ranks hold the model FSDP-sharded, so
each rank owns a quarter of every tensor. Every contender runs in fresh processes: build the
model, note the RSS, reset the peak (VmHWM), load once, and take peak extra RSS per rank = peak -
RSS before (the first load, in a process that has not loaded yet); then the load time is the best
of 3 (barriers around each, wall = slowest rank). Contenders:

- ``mesh3d``: ``load_pretrained(folder, model)``, fp32 file into the fp32 model;
- ``mesh3d_cast``: ``load_pretrained(bf16 folder, model, dtype=torch.float32)`` (slices go through
  the read buffer);
- ``dcp_hf``: ``dcp.load(get_model_state_dict(model), storage_reader=HuggingFaceStorageReader(folder))``
  then ``set_model_state_dict``, the same fp32 file.

The files were just written, so reads are warm page cache (mesh3d preads into the parameters;
page-cache pages are not RSS unless a contender maps the file).

Usage::

    python scripts/bench_pretrained.py                       # 256 MB, about a minute
    python scripts/bench_pretrained.py --size-mb 1024 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model, peak_rss_kb, reset_peak_rss, rss_kb  # noqa: E402

WORLD = 4
REPEATS = 3
CONTENDERS = ("mesh3d", "mesh3d_cast", "dcp_hf")


def _model(size_mb: int, layer_mb: int) -> torch.nn.Module:
    rows = layer_mb * 1024 * 1024 // 4 // 1024
    return torch.nn.Sequential(*[torch.nn.Linear(1024, rows) for _ in range(max(1, size_mb // layer_mb))])


def _rank_main(rank: int, port: int, contender: str, args: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import faulthandler

    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from mesh3d import DistributedManager, checkpoint
    from mesh3d.checkpoint.chunks import local_box

    dm = DistributedManager.initialize(WORLD, 1, 1)
    with torch.device("meta"):
        model = _model(args.size_mb, args.layer_mb)
    for layer in model:
        fully_shard(layer, mesh=dm.batch_domain_mesh)
    fully_shard(model, mesh=dm.batch_domain_mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # touch every page, so the baseline RSS holds the whole sharded model
    boxes = [local_box(n, t).numel * 4 for n, t in get_model_state_dict(model).items()]
    info: dict = {}

    def load(_i: int) -> None:
        if contender == "dcp_hf":
            state = get_model_state_dict(model)
            dcp.load(state, storage_reader=HuggingFaceStorageReader(os.path.join(root, "fp32")))
            set_model_state_dict(model, state)
        elif contender == "mesh3d":
            info["i"] = checkpoint.load_pretrained(os.path.join(root, "fp32"), model)
        else:
            info["i"] = checkpoint.load_pretrained(os.path.join(root, "bf16"), model, dtype=torch.float32)

    gc.collect()
    dist.barrier()
    base = rss_kb()
    reset_peak_rss()
    load(0)
    extra_kb = peak_rss_kb() - base
    best = float("inf")
    for i in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        load(i)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    check = sum(float(p.detach().to_local().double().sum()) for p in model.parameters())
    doc = {"rank": rank, "seconds": best, "peak_extra_rss_mb": extra_kb / 1024, "owned_mb": sum(boxes) / 2**20,
           "largest_owned_slice_mb": max(boxes) / 2**20, "param_sum": check,
           "read_buffer_mb": info["i"].read_buffer_bytes / 2**20 if "i" in info else None,
           "bytes_read_mb": info["i"].bytes_read / 2**20 if "i" in info else None}
    with open(os.path.join(root, f"{contender}-{rank}.json"), "w") as f:
        json.dump(doc, f)
    DistributedManager.shutdown()
    dist.destroy_process_group()


def _write_files(root: str, args: argparse.Namespace) -> tuple[int, int]:
    import safetensors.torch

    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in _model(args.size_mb, args.layer_mb).state_dict().items()}
    for name, tensors in (("fp32", sd), ("bf16", {k: v.bfloat16() for k, v in sd.items()})):
        os.makedirs(os.path.join(root, name))
        safetensors.torch.save_file(tensors, os.path.join(root, name, "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * 4 for t in sd.values()), max(t.numel() * 4 for t in sd.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="model size (MB of fp32 weights)")
    parser.add_argument("--layer-mb", type=int, default=32, help="size of each Linear weight (MB)")
    parser.add_argument("--out", default="docs/benchmarks", help="where pretrained.json goes")
    parser.add_argument("--hang-s", type=float, default=300, help="dump stacks and exit if a rank runs this long")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-pretrained-", dir=args.workdir)
    runs: dict[str, list[dict]] = {}
    try:
        total, largest = _write_files(root, args)
        for contender in CONTENDERS:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_rank_main, args=(port, contender, args, root), nprocs=WORLD, start_method="spawn")
            runs[contender] = [json.load(open(os.path.join(root, f"{contender}-{r}.json"))) for r in range(WORLD)]
            print(f"  {contender:<12} {max(d['seconds'] for d in runs[contender]):.3f} s, peak extra RSS per rank "
                  f"{[round(d['peak_extra_rss_mb'], 1) for d in runs[contender]]} MB", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = [abs(a["param_sum"] - b["param_sum"]) <= 1e-6 * max(1.0, abs(a["param_sum"]))
            for a, b in zip(runs["mesh3d"], runs["dcp_hf"])]
    m, c, d = (runs[k] for k in CONTENDERS)
    budget = [r["largest_owned_slice_mb"] + (r["read_buffer_mb"] or 0) for r in m + c]
    report = {
        "config": {"ranks": WORLD, "layout": "FSDP over 4 ranks", "file_bytes_fp32": total, "cpu": cpu_model(),
                   "largest_tensor_mb": largest / 2**20, "layer_mb": args.layer_mb, "torch": torch.__version__,
                   "cpu_count": os.cpu_count(), "note": "gloo on CPU; warm page cache; time = best of 3, "
                   "peak extra RSS = first load in a fresh process"},
        "seconds": {k: max(r["seconds"] for r in v) for k, v in runs.items()},
        "peak_extra_rss_mb_max_rank": {k: max(r["peak_extra_rss_mb"] for r in v) for k, v in runs.items()},
        "per_rank": runs,
        "ratios": {"time_dcp_over_mesh3d": max(r["seconds"] for r in d) / max(r["seconds"] for r in m),
                   "time_dcp_over_mesh3d_cast": max(r["seconds"] for r in d) / max(r["seconds"] for r in c)},
        "goal_peak_extra_within_largest_slice_plus_buffer": all(
            r["peak_extra_rss_mb"] <= b for r, b in zip(m + c, budget)),
        "same_weights_as_dcp": all(same),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pretrained.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "per_rank"}, indent=2))


if __name__ == "__main__":
    main()
