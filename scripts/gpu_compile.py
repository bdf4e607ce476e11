"""The compile part of ``scripts/gpu_check.py``: torch.compile of domain tensors on one GPU (D=1).

Usage (gpu_check.py calls it; alone, on any device, as a smoke run)::

    python scripts/gpu_compile.py --device cuda --repeats 100
    python scripts/gpu_compile.py --device cpu --check-only

Three things, all on the device the manager picked:
* a check: a U-Net (conv, GroupNorm, max pooling, transposed conv, bilinear upsampling, skips) and a strided
  conv/GroupNorm stack, compiled with Inductor on a domain tensor, train like the eager plain model (fp64, 3 SGD steps:
  losses, gradients, parameters to rel 1e-9);
* timings, the rows of ``bench_compile.py``'s D=1 part: compiled domain against compiled plain torch (goal <= 1.05)
  and eager domain against eager plain, the small conv stack (2x16x48x48) and U-Net steps. Compile time, graph
  breaks, recompiles after the first step, and peak device memory of one step (domain over plain, goal <= 1.05).
  ``--cudagraphs`` times the rows with Inductor's ``triton.cudagraphs`` instead (on torch 2.11 the domain step's
  first backward then failed: "accessing tensor output of CUDAGraphs that has been overwritten"; docs/limitations.md);
* the host overhead: forward, backward and ``domain.shard`` timed apart on a tiny field, where host work is all a
  step is (what the domain path adds there decides the small stack's ratio on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import UNet, conv_stack, paired_times  # noqa: E402
from bench_compile import _after_timing, _first_call, _own_code  # noqa: E402

from mesh3d import DistributedManager, domain  # noqa: E402
from mesh3d._torch_private import run_compiled_graphs_without_subclass_dispatch  # noqa: E402

__all__ = ["check_compiled_equals_eager", "host_overhead", "peak_bytes", "time_compile"]


def _strided_stack() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 5, padding=2, padding_mode="circular"), nn.GroupNorm(2, 8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.GELU(),
                         nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Conv2d(4, 1, 3, padding=1))


def check_compiled_equals_eager(device: torch.device) -> str:
    """Inductor-compiled domain steps against eager plain ones, fp64, 3 SGD steps; raises on any difference."""
    run_compiled_graphs_without_subclass_dispatch()  # NOTE: a no-op on torch >= 2.13; GPU images may ship 2.11
    worst = 0.0
    for name, make, shape in (("U-Net", lambda: UNet(8), (2, 3, 32, 24)), ("strided stack", _strided_stack, (2, 3, 34, 20))):
        torch.manual_seed(0)
        plain = make().to(device, torch.float64)
        sharded = copy.deepcopy(plain)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, sharded)]
        step = torch.compile(_own_code(lambda t: (sharded(t) ** 2).mean()), dynamic=False,
                             options={"guard_filter_fn": domain.guard_filter})
        for i in range(3):
            x = torch.randn(*shape, device=device, dtype=torch.float64)
            ref, got = (plain(x) ** 2).mean(), step(domain.shard(x, dim=2))
            ref.backward()
            got.backward()
            worst = max(worst, abs(float(got.detach()) - float(ref.detach())) / abs(float(ref.detach())))
            for (pname, p), q in zip(plain.named_parameters(), sharded.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=f"{name} step {i}: {pname}.grad")
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for (pname, p), q in zip(plain.named_parameters(), sharded.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12, msg=f"{name}: {pname}")
    return f"(U-Net and strided stack, Inductor, fp64, 3 SGD steps; max loss rel diff {worst:.1e})"


def _steps(model: nn.Module, make_input, domain_input: bool, cudagraphs: bool):
    """(eager step, compiled step) as ``bench_compile._steps``; ``cudagraphs``: Inductor replays CUDA graphs."""
    def loss(t):
        return (model(t) ** 2).mean()

    options: dict = {"guard_filter_fn": domain.guard_filter} if domain_input else {}
    if cudagraphs:
        options["triton.cudagraphs"] = True
    compiled = torch.compile(_own_code(loss), dynamic=False, options=options or None)

    def compiled_step() -> None:
        if cudagraphs:  # NOTE: a new training step: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        compiled(make_input()).backward()

    return (lambda: loss(make_input()).backward()), compiled_step


def peak_bytes(step, device: torch.device) -> int:
    """The most device memory ``step`` allocates above what is allocated before it (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_compile(device: torch.device, repeats: int, cudagraphs: bool = False) -> dict:
    """Rows: D=1 compiled domain against compiled plain (and eager against eager), one per model."""
    run_compiled_graphs_without_subclass_dispatch()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: dict = {}
    models = (("conv stack 2x16x48x48", lambda: conv_stack(16, 4), (2, 1, 48, 48)),
              ("U-Net 2x3x64x64", UNet, (2, 3, 64, 64)),
              ("U-Net 4x3x256x256", UNet, (4, 3, 256, 256)))
    for name, make, shape in models:
        torch.manual_seed(0)
        model = make().to(device)
        x = torch.randn(*shape, device=device)
        plain_eager, plain_compiled = _steps(model, lambda x=x: x, False, cudagraphs)
        domain_eager, domain_compiled = _steps(model, lambda x=x: domain.shard(x, dim=2), True, cudagraphs)
        plain_stats: dict = {}
        stats: dict = {}
        _first_call(plain_compiled, plain_stats)
        _first_call(domain_compiled, stats)
        t_plain, t_domain = paired_times(plain_compiled, domain_compiled, repeats, sync)
        _after_timing(stats)
        e_plain, e_domain = paired_times(plain_eager, domain_eager, repeats, sync)
        mem_plain, mem_domain = peak_bytes(plain_compiled, device), peak_bytes(domain_compiled, device)
        shard_s, _ = paired_times(lambda x=x: domain.shard(x, dim=2), lambda: None, repeats, lambda: None)
        row = {"compiled_plain_ms": t_plain * 1e3, "compiled_domain_ms": t_domain * 1e3,
               "compiled_domain_vs_compiled_plain": t_domain / t_plain,
               "eager_plain_ms": e_plain * 1e3, "eager_domain_ms": e_domain * 1e3,
               "eager_domain_vs_eager_plain": e_domain / e_plain, "shard_us": shard_s * 1e6,
               "compiled_peak_bytes_plain": mem_plain, "compiled_peak_bytes_domain": mem_domain,
               "compiled_peak_domain_vs_plain": mem_domain / mem_plain if mem_plain else None, **stats}
        label = f"{name}{' cudagraphs' if cudagraphs else ''}"
        rows[label] = row
        mem = f"; peak memory {row['compiled_peak_domain_vs_plain']:.3f}x" if mem_plain else ""
        print(f"  D=1 {label}: compiled domain {t_domain * 1e3:.3f} ms = {t_domain / t_plain:.3f}x compiled plain "
              f"({t_plain * 1e3:.3f} ms; domain.shard {shard_s * 1e6:.0f} us); "
              f"eager {e_domain * 1e3:.3f} ms = {e_domain / e_plain:.3f}x eager plain; "
              f"compile {stats['compile_s']:.1f} s, {stats['graph_breaks']} graph breaks, "
              f"{stats['recompiles']} recompiles{mem}", flush=True)
        torch._dynamo.reset()  # each row's graphs (and CUDA-graph pools) go with it
    return rows


def host_overhead(device: torch.device, repeats: int) -> dict:
    """What the domain path adds per compiled step where host work is all there is: the conv stack on a tiny field
    (2x1x8x8), forward, backward and ``domain.shard`` timed apart, each a median of ``repeats`` alternated steps."""
    run_compiled_graphs_without_subclass_dispatch()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = conv_stack(16, 4).to(device)
    x = torch.randn(2, 1, 8, 8, device=device)
    plain = torch.compile(_own_code(lambda t: (model(t) ** 2).mean()), dynamic=False)
    sharded = torch.compile(_own_code(lambda t: (model(t) ** 2).mean()), dynamic=False,
                            options={"guard_filter_fn": domain.guard_filter})
    times: dict[str, list[float]] = {key: [] for key in ("fwd_plain", "fwd_domain", "bwd_plain", "bwd_domain", "shard")}
    for step in range(repeats + 3):
        for name, fn, make in (("plain", plain, lambda: x), ("domain", sharded, lambda: domain.shard(x, dim=2))):
            start = time.perf_counter()
            inp = make()
            shard_s = time.perf_counter() - start
            sync()
            start = time.perf_counter()
            loss = fn(inp)
            sync()
            mid = time.perf_counter()
            loss.backward()
            sync()
            if step >= 3:  # the first steps compile
                times[f"fwd_{name}"].append(mid - start)
                times[f"bwd_{name}"].append(time.perf_counter() - mid)
                if name == "domain":
                    times["shard"].append(shard_s)
    us = {key: statistics.median(v) * 1e6 for key, v in times.items()}
    row = {**{f"{key}_us": v for key, v in us.items()}, "fwd_extra_us": us["fwd_domain"] - us["fwd_plain"],
           "bwd_extra_us": us["bwd_domain"] - us["bwd_plain"]}
    print(f"  D=1 host overhead (2x1x8x8 conv stack, {repeats} alternated steps, medians): forward "
          f"+{row['fwd_extra_us']:.1f} us ({us['fwd_plain']:.1f} plain), backward +{row['bwd_extra_us']:.1f} us "
          f"({us['bwd_plain']:.1f} plain), domain.shard {us['shard']:.1f} us", flush=True)
    torch._dynamo.reset()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=100, help="timed steps per row, alternated")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--check-only", action="store_true", help="the compiled == eager check, no timings")
    parser.add_argument("--cudagraphs", action="store_true", help="time with Inductor's CUDA graphs")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
        # NOTE: Inductor then calls extern_kernels.convolution on graph inputs, as it does on CUDA
        torch._inductor.config.cpp.weight_prepack = False
    dm = DistributedManager.initialize(backend="nccl" if args.device == "cuda" else "gloo")
    print("compiled == eager:", check_compiled_equals_eager(dm.device), flush=True)
    rows = {} if args.check_only else time_compile(dm.device, args.repeats, args.cudagraphs and args.device == "cuda")
    overhead = {} if args.check_only else host_overhead(dm.device, 10 * args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows, "host_overhead": overhead},
                                             indent=1))
    DistributedManager.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
