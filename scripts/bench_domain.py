"""Benchmark the domain axis: its cost at one rank, its Python dispatch cost, and strong scaling.

Usage::

    python scripts/bench_domain.py                        # all parts, CPU, ~3 minutes on 2 cores
    python scripts/bench_domain.py --quick                # smaller sizes (a smoke run; do not publish)
    python scripts/bench_domain.py --device cuda --parts ops dispatch   # the one-rank parts on a GPU

Parts (each against plain torch on the same inputs, in the same run):
1. ``ops``: forward+backward of single ops (conv 2-D/3-D, transposed conv, GroupNorm, BatchNorm,
   pooling, interpolate, pointwise, SDPA) and of a whole U-Net step on a domain tensor at domain=1,
   over the plain module: the "tax" of the wrapper when nothing moves (goal: U-Net step <= 1.05).
2. ``dispatch`` (``bench_domain_dispatch.py``): the Python cost per op on tiny tensors, in microseconds (goals: <= 8 us
   for element-wise and view ops, <= 12 us for a convolution: issue 50), against plain torch, the dispatcher's walk
   (kept answers off) and a DTensor, and the Python time of ``full_tensor`` on 10^6 rows (goal < 5 ms).
3. ``scaling``: a conv stack on one large field over D = 1, 2, 4 processes, one thread each: step
   time (goal: D=2 at least 1.8x faster than D=1), bytes sent vs the minimum halo bytes, time spent
   inside exchanges (the most that overlapping them with compute could hide), activation bytes and
   peak RSS per rank vs plain torch in one process.
4. ``compile``: ``torch.compile`` (scripts/bench_compile.py): compiled domain vs compiled plain at D=1, compiled vs
   eager at D=2 and 4, compile time, graph breaks, recompiles, peak memory.
Writes docs/benchmarks/domain.json and domain.png (the compile part: domain_compile.json and .png);
scripts/bench_report.py puts them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh3d import domain  # noqa: E402
from bench_common import (UNet, cpu_model, paired_times)
from bench_compile import add_arguments as add_compile_arguments, part_compile, plot_compile  # noqa: E402
from bench_domain_dispatch import part_dispatch, plot_dispatch  # noqa: E402
from bench_domain_scaling import part_overlap, part_scaling  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


# ----------------------------------------------------------------------------- part 1: ops at domain=1
def _op_cases(size: int, dtype, device):
    s, s3 = size, max(size // 8, 8)
    x2 = lambda c=16: torch.randn(2, c, s, s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    conv = nn.Conv2d(16, 16, 3, padding=1).to(device, dtype)
    conv3 = nn.Conv3d(8, 8, 3, padding=1).to(device, dtype)
    tconv = nn.ConvTranspose2d(16, 8, 2, stride=2).to(device, dtype)
    gn, bn = nn.GroupNorm(4, 16).to(device, dtype), nn.BatchNorm2d(16).to(device, dtype)
    seq = torch.randn(2, 4, 4 * s, 32, dtype=dtype, device=device, requires_grad=True)
    return {
        "conv2d 3x3": (conv, x2(), 2),
        "conv3d 3x3x3": (conv3, torch.randn(2, 8, s3, s3, s3, dtype=dtype, device=device, requires_grad=True), 2),
        "conv_transpose2d": (tconv, x2(), 2),
        "group_norm": (gn, x2(), 2),
        "batch_norm (train)": (bn, x2(), 2),
        "max_pool2d": (lambda t: F.max_pool2d(t, 2), x2(), 2),
        "avg_pool2d": (lambda t: F.avg_pool2d(t, 3, 1, 1), x2(), 2),
        "interpolate bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), x2(), 2),
        "pointwise (gelu, add)": (lambda t: F.gelu(t) + t, x2(), 2),
        "sdpa": (lambda t: F.scaled_dot_product_attention(t, t, t), seq, 2),
    }


def part_ops(args, device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.float32
    results = {}
    for name, (fn, x, dim) in _op_cases(args.op_size, dtype, device).items():
        def plain(fn=fn, x=x):
            fn(x).sum().backward()

        def sharded(fn=fn, x=x, dim=dim):
            fn(domain.shard(x, dim=dim)).sum().backward()

        a, b = paired_times(plain, sharded, args.repeats * args.rounds, sync)
        a, b = [a], [b]
        results[name] = {"plain_s": min(a), "domain_s": min(b), "slowdown": min(b) / min(a)}
        print(f"  {name:24s} {min(a) * 1e3:8.2f} ms  x{min(b) / min(a):.3f}", flush=True)
    torch.manual_seed(0)
    unet = UNet().to(device, dtype)
    x = torch.randn(2, 3, args.unet_size, args.unet_size, dtype=dtype, device=device)
    target = torch.randn(2, 1, args.unet_size, args.unet_size, dtype=dtype, device=device)

    def unet_plain():
        F.mse_loss(unet(x), target).backward()

    def unet_domain():
        F.mse_loss(unet(domain.shard(x, dim=2)), domain.shard(target, dim=2)).backward()

    a, b = paired_times(unet_plain, unet_domain, args.repeats * args.rounds, sync)
    a, b = [a], [b]
    results["U-Net step"] = {"plain_s": min(a), "domain_s": min(b), "slowdown": min(b) / min(a)}
    print(f"  {'U-Net step':24s} {min(a) * 1e3:8.2f} ms  x{min(b) / min(a):.3f}", flush=True)
    return results


# ----------------------------------------------------------------------------- report
def _plot(report: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [k for k in ("ops", "dispatch", "scaling") if k in report]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "ops":
            names = list(report["ops"])
            ax.barh(names, [report["ops"][n]["slowdown"] for n in names])
            ax.axvline(1.05, color="red", linestyle="--", label="goal 1.05 (U-Net step)")
            ax.set_xlabel("domain=1 time / plain torch (fwd+bwd)")
            ax.legend(loc="lower right")
        elif key == "dispatch":
            plot_dispatch(ax, report["dispatch"])
        else:
            runs = report["scaling"]
            ds = [r["domain"] for r in runs]
            ax.plot(ds, [r["speedup_vs_one_rank"] for r in runs], "o-", label="speedup vs D=1")
            ax.plot(ds, ds, "--", color="grey", label="ideal")
            ax.plot(ds, [r["activation_vs_plain_torch"] * r["domain"] for r in runs], "s-",
                    label="activation/rank x D vs plain")
            ax.set_xlabel("domain size D (processes, 1 thread each)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "domain.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["ops", "dispatch", "scaling", "overlap", "compile"],
                        choices=["ops", "dispatch", "scaling", "overlap", "compile"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--op-size", type=int, default=128)
    parser.add_argument("--unet-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dispatch-calls", type=int, default=2000)
    parser.add_argument("--dispatch-rounds", type=int, default=5, help="dispatch: the best of this many rounds")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--domains", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=str(OUT / "domain.json"))
    add_compile_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.op_size, args.unet_size, args.size, args.rounds, args.repeats = 32, 32, 128, 1, 2
        args.dispatch_calls, args.dispatch_rounds, args.steps = 200, 1, 2
        args.compile_unet, args.compile_repeats = 32, 3
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    report = {"config": {**vars(args), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                         "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "cpu": cpu_model()}}
    if "ops" in args.parts:
        print("== one rank: domain wrapper vs plain torch, forward+backward", flush=True)
        report["ops"] = part_ops(args, device)
    if "dispatch" in args.parts:
        print("== Python dispatch cost per op (tiny tensors)", flush=True)
        report["dispatch"] = part_dispatch(args, device)
        # NOTE: its own record of where it ran, so this part can be rerun alone and merged into domain.json
        report["dispatch"]["measured_on"] = {k: report["config"][k] for k in
                                             ("cpu", "torch", "device_name", "dispatch_calls", "dispatch_rounds")}
    if "scaling" in args.parts and device.type == "cpu":
        print(f"== strong scaling: {args.layers}-conv stack, {args.batch}x1x{args.size}x{args.size}", flush=True)
        report["scaling"] = part_scaling(args)
    if "overlap" in args.parts and device.type == "cpu":
        print("== overlap: halo messages in flight while the interior rows are computed (D=2)", flush=True)
        report["overlap"] = part_overlap(args)
    OUT.mkdir(parents=True, exist_ok=True)
    if "compile" in args.parts and device.type == "cpu":
        # NOTE: a file of its own (docs/benchmarks/domain_compile.json), so this part can be rerun alone
        print("== torch.compile: compiled domain steps vs compiled plain (D=1) and vs eager (D=2, 4)", flush=True)
        compiled = {"config": report["config"], **part_compile(args)}
        (OUT / "domain_compile.json").write_text(json.dumps(compiled, indent=2) + "\n")
        plot_compile(compiled, OUT / "domain_compile.png")
        if args.parts == ["compile"]:
            print(f"wrote {OUT / 'domain_compile.json'}")
            return
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if Path(args.out).resolve() == (OUT / "domain.json").resolve():
        _plot(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
