#!/usr/bin/env python
"""Benchmark: a Lightning fit with mesh3d's ``MeshStrategy`` vs Lightning's own ``ModelParallelStrategy``.

The same LightningModule (examples/train_transformer.py's Transformer, FSDP over 2 data-parallel
ranks x tensor parallelism over 2), the same data, 4 CPU ranks started by Lightning's own launcher.
With ``ModelParallelStrategy`` the module parallelizes itself by hand in ``configure_model``
(``parallelize_module`` + ``fully_shard``, as Lightning's docs show); with ``MeshStrategy`` it has no
parallel code and the strategy applies one ``Plan``. Reports step-time and peak-memory ratios
(MeshStrategy / ModelParallelStrategy; goal <= 1.03 each) and writes ``docs/benchmarks/lightning.json``
(+ ``lightning.png`` when matplotlib is importable).

Usage::

    python scripts/bench_lightning.py                    # 3 rounds, each variant in its own launch
    python scripts/bench_lightning.py --rounds 5 --dim 256 --steps 30

Step time: the median over steps after warm-up, on rank 0 (every step ends in collectives, so the
ranks move together); the variants alternate launch by launch and the median over rounds is
compared. Peak memory: growth of peak RSS over the RSS before the module was built, max over ranks.
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
VARIANTS = ("mesh3d", "lightning")


def worker(args: argparse.Namespace) -> None:
    """One fit (this process and the 3 Lightning starts), timing every step."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "examples"))
    from train_transformer import Transformer, make_plan

    from lightning.pytorch.strategies import ModelParallelStrategy

    from mesh3d.lightning import MeshStrategy

    torch.set_num_threads(1)
    base_rss = rss_kb() / 1024  # after both variants' imports: only what the fit allocates counts

    class LM(pl.LightningModule):
        def __init__(self, by_hand: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Transformer(vocab=args.vocab, dim=args.dim, n_heads=args.heads, layers=args.layers)
            self.by_hand = by_hand

        def configure_model(self) -> None:
            if not self.by_hand or getattr(self, "_done", False):
                return
            # What Lightning's ModelParallelStrategy asks of the user (its docs' pattern), with the
            # same styles, units and SUM reductions as mesh3d's plan (gloo has no AVG reduce-scatter).
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            tp = {"tok": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
            for i in range(args.layers):
                tp.update({f"layers.{i}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "up")})
                tp.update({f"layers.{i}.{w}": RowwiseParallel() for w in ("wo", "down")})
            parallelize_module(self.net, tp_mesh, tp)
            for block in self.net.layers:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.net, mesh=dp_mesh, reshard_after_forward=False)
            for module in self.net.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
            self._done = True

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            n = (args.warmup + args.steps) * args.global_batch
            tokens = torch.randint(0, args.vocab, (n, args.seq + 1), generator=g)
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.global_batch // 2)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._start)

    if args.variant == "mesh3d":
        plan = make_plan()
        plan.model = {f"net.{k}": v for k, v in plan.model.items()}
        strategy = MeshStrategy(batch=2, domain=1, model=2, plan=plan)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    clock = Clock()
    module = LM(by_hand=args.variant == "lightning")
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.warmup + args.steps,
                         callbacks=[clock], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=True)
    trainer.fit(module)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if trainer.is_global_zero:
        Path(args.result).write_text(json.dumps({"step_s": statistics.median(clock.times[args.warmup:]),
                                                 "peak_rss_growth_mb": float(peak)}))


def _launch(variant: str, args: argparse.Namespace, result: str) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--result", result,
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _MODEL_ARGS)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    if done.returncode != 0:
        raise SystemExit(f"{variant} launch failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(Path(result).read_text())


_MODEL_ARGS = ("vocab", "dim", "heads", "layers", "seq", "global_batch", "warmup", "steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, help="(internal) run one fit of this variant")
    parser.add_argument("--result", help="(internal) where rank 0 writes its figures")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--launch-timeout", type=float, default=600)
    parser.add_argument("--out", default="docs/benchmarks/lightning.json")
    args = parser.parse_args()
    if args.variant:
        worker(args)
        return

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # alternate who goes first
            for variant in order:
                got = _launch(variant, args, os.path.join(tmp, f"{variant}-{r}.json"))
                runs[variant].append(got)
                print(f"  round {r + 1}/{args.rounds} {variant:<9} step {got['step_s'] * 1e3:7.1f} ms, "
                      f"peak RSS +{got['peak_rss_growth_mb']:.0f} MB", flush=True)
    step = {v: statistics.median(x["step_s"] for x in runs[v]) for v in VARIANTS}
    mem = {v: statistics.median(x["peak_rss_growth_mb"] for x in runs[v]) for v in VARIANTS}
    report = {
        "config": {k: getattr(args, k) for k in ("rounds", *_MODEL_ARGS)} | {"ranks": 4, "mesh": "batch 2 x model 2",
                                                                           "cpu_count": os.cpu_count()},
        "step_s": step, "peak_rss_growth_mb": mem, "runs": runs,
        "step_time_ratio": step["mesh3d"] / step["lightning"],
        "peak_memory_ratio": mem["mesh3d"] / mem["lightning"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"MeshStrategy / ModelParallelStrategy: step time {report['step_time_ratio']:.3f}, "
          f"peak memory {report['peak_memory_ratio']:.3f} (goal <= 1.03 each) -> {out}")
    if not plot_ratios(out.with_suffix(".png"), report["step_time_ratio"], report["peak_memory_ratio"],
                       ylabel="MeshStrategy / ModelParallelStrategy"):
        print("matplotlib not importable: no PNG written")

if __name__ == "__main__":
    main()
