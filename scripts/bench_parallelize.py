"""Benchmark: one training step with ``mesh3d.parallelize`` vs the same transforms written by hand.

Same model (examples/train_transformer.py's Transformer), same mesh, same FSDP units and TP
styles; the hand-written side calls ``parallelize_module`` + ``fully_shard`` directly. Reports
step-time and peak-memory ratios (mesh3d / by hand; goal <= 1.03 each) and writes
``docs/benchmarks/parallelize.json``.

Usage::

    python scripts/bench_parallelize.py                 # 4 CPU ranks (batch=2 x model=2), small sizes
    python scripts/bench_parallelize.py --nproc 8 --batch 4 --model 2 --dim 256 --rounds 20

Step time: both variants live in the same processes and alternate step by step (A, B, B, A ...),
so machine noise hits both alike; the median over rounds is compared. The model built first runs
a few percent slower (seen both ways round), so timing runs twice, once per build order, and the
reported ratio is the geometric mean of the two. Peak memory: each variant
runs in its own launch, and the growth of peak RSS over the RSS before the model was built is
taken (max over ranks); CPU has no allocator high-water mark like CUDA's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import plot_ratios, rss_kb  # noqa: E402


def _build(variant: str, args, dm):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor import Replicate

    sys.path.insert(0, str(ROOT / "examples"))
    from train_transformer import Transformer, make_plan

    from mesh3d import parallelize

    torch.manual_seed(0)
    model = Transformer(vocab=args.vocab, dim=args.dim, n_heads=args.heads, layers=args.layers)
    if variant == "mesh3d":
        return parallelize(model, make_plan())
    # By hand: the TP plan, then FSDP per block and the root over the batch×domain mesh, with
    # the same SUM reductions mesh3d uses (gloo has no AVG/PREMUL_SUM for FSDP's reduce-scatter).
    tp = {"tok": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(args.layers):
        tp.update({f"layers.{i}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "up")})
        tp.update({f"layers.{i}.{w}": RowwiseParallel() for w in ("wo", "down")})
    parallelize_module(model, dm.axis_mesh("model"), tp)
    for block in model.layers:
        fully_shard(block, mesh=dm.batch_domain_mesh)
    fully_shard(model, mesh=dm.batch_domain_mesh, reshard_after_forward=False)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(batch=args.batch, domain=1, model=args.model)
    # "both" builds mesh3d first, "both_swapped" the hand-written model first: the model built
    # first runs a few percent slower here (allocation order), whichever it is.
    variants = {"both": ["mesh3d", "manual"], "both_swapped": ["manual", "mesh3d"]}.get(args.variant, [args.variant])
    base_rss = rss_kb()
    models = {v: _build(v, args, dm) for v in variants}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
    g = torch.Generator().manual_seed(dm.axis_rank("batch"))
    tokens = torch.randint(0, args.vocab, (args.per_rank, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step(v):
        loss = F.cross_entropy(models[v](x).flatten(0, 1), y.flatten())
        loss.backward()
        opts[v].step()
        opts[v].zero_grad(set_to_none=True)

    times = {v: [] for v in variants}
    for r in range(args.warmup + args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            step(v)
            dist.barrier()
            if r >= args.warmup:
                times[v].append(time.perf_counter() - t0)
    peak_growth = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss], dtype=torch.float64)
    dist.all_reduce(peak_growth, op=dist.ReduceOp.MAX)
    if dm.rank == 0:
        result = {v: {"median_step_s": statistics.median(t), "steps": len(t)} for v, t in times.items()}
        result["peak_rss_growth_kb"] = peak_growth.item()
        Path(args.out).write_text(json.dumps(result))
    DistributedManager.shutdown()


def launch(args, variant: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           __file__, "--worker", "--variant", variant, "--out", out]
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("batch", "model", "dim", "heads", "layers", "vocab", "seq", "per_rank", "rounds", "warmup")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="both", choices=["both", "both_swapped", "mesh3d", "manual"])
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "parallelize.json"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--model", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--per-rank", dest="per_rank", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    timings = [launch(args, "both"), launch(args, "both_swapped")]
    ratios = [t["mesh3d"]["median_step_s"] / t["manual"]["median_step_s"] for t in timings]
    memory = {v: launch(args, v)["peak_rss_growth_kb"] for v in ("mesh3d", "manual")}
    report = {
        "what": "one AdamW step, mesh3d.parallelize vs parallelize_module + fully_shard by hand",
        "config": {k: getattr(args, k) for k in ("nproc", "batch", "model", "dim", "heads", "layers", "vocab", "seq",
                                                 "per_rank", "rounds", "warmup")},
        "device": "cpu/gloo",
        "median_step_s": [{v: t[v]["median_step_s"] for v in ("mesh3d", "manual")} for t in timings],
        "step_time_ratio_by_build_order": {"mesh3d_built_first": ratios[0], "manual_built_first": ratios[1]},
        # Geometric mean over the two build orders cancels the order effect.
        "step_time_ratio": (ratios[0] * ratios[1]) ** 0.5,
        "peak_rss_growth_kb": memory,
        "peak_memory_ratio": memory["mesh3d"] / memory["manual"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    plot_ratios(Path(args.out).with_suffix(".png"), report["step_time_ratio"], report["peak_memory_ratio"],
                ylabel="mesh3d / by hand")

if __name__ == "__main__":
    main()
