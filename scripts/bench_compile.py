"""Benchmark ``torch.compile`` on domain tensors: the ``compile`` part of ``scripts/bench_domain.py``.

Usage::

    python scripts/bench_domain.py --parts compile          # inside the domain benchmark (docs/benchmarks/domain.json)
    python scripts/bench_compile.py --quick                 # this part alone, small sizes (a smoke run)

Rows, all in one run, each against its alternative measured alternately in the same process:
1. one rank (D=1): the small conv stack (2x16x48x48) and the U-Net step, compiled domain vs compiled plain torch
   (goal <= 1.05), with eager rows for reference;
2. D = 2 and 4 (processes, one thread each): a conv/GroupNorm stack on a larger field (1024x512), compiled vs eager;
3. for every compiled row: compile time (first call), Dynamo graph breaks and recompiles after the first step;
4. peak memory per rank (peak RSS growth over one forward+backward) at D=2 and 4, eager and compiled, over plain
   torch in one process (goal at D=2: <= 0.55);
5. at D = 2 and 4, two self-attention blocks on a sequence sharded over the domain, compiled (the attention one
   custom op in the graph) against eager, with graph breaks and recompiles;
6. at D = 4 as a 2x2 grid of blocks, a field flattened into a token grid with SDPA over every token (the same custom
   op), compiled against eager in the ring and gather modes, with graph breaks and recompiles.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh3d import DistributedManager, domain  # noqa: E402
from bench_common import UNet, conv_stack, paired_times, peak_rss_kb, reset_peak_rss, rss_kb, spawn_ranks  # noqa: E402

__all__ = ["part_compile"]


def _own_code(fn):
    """``fn`` with a code object of its own. NOTE: Dynamo keeps its compiled graphs per code object; the rows' losses
    share one, and a call would first check (and fail) the guards of every other row's graph, which a training
    script compiling one step never does."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _steps(model, make_input, domain_input: bool = False):
    """(eager step, compiled step): forward and loss, then backward; compiled, the model and loss are one
    ``torch.compile``d function and the input is made (sharded) and the backward run outside it, as in training.
    A domain input's step is compiled as docs/domain.md says to: with ``domain.guard_filter``."""
    def loss(t):
        return (model(t) ** 2).mean()

    options = {"guard_filter_fn": domain.guard_filter} if domain_input else None
    # NOTE: static shapes, as Plan(compile=...) does
    compiled_loss = torch.compile(_own_code(loss), dynamic=False, options=options)
    return (lambda: loss(make_input()).backward()), (lambda: compiled_loss(make_input()).backward())


def _first_call(fn, stats: dict) -> None:
    counters.clear()
    start = time.perf_counter()
    fn()
    stats["compile_s"] = time.perf_counter() - start
    stats["graphs_after_first_step"] = counters["stats"]["unique_graphs"]
    stats["graph_breaks"] = sum(counters["graph_break"].values())


def _after_timing(stats: dict) -> None:
    stats["recompiles"] = counters["stats"]["unique_graphs"] - stats["graphs_after_first_step"]


def _one_rank(args) -> dict:

    DistributedManager.initialize()
    rows = {}
    for name, make, shape in (("conv stack 2x16x48x48", lambda: conv_stack(16, 4), (2, 1, args.compile_small, args.compile_small)),
                              ("U-Net step", UNet, (2, 3, args.compile_unet, args.compile_unet))):
        torch.manual_seed(0)
        model = make()
        x = torch.randn(*shape)

        plain_step, compiled_plain = _steps(model, lambda x=x: x)
        domain_step, compiled_domain = _steps(model, lambda x=x: domain.shard(x, dim=2), domain_input=True)
        plain_stats: dict = {}
        domain_stats: dict = {}
        _first_call(compiled_plain, plain_stats)
        _first_call(compiled_domain, domain_stats)
        t_plain, t_domain = paired_times(compiled_plain, compiled_domain, args.compile_repeats, lambda: None)
        _after_timing(domain_stats)
        e_plain, e_domain = paired_times(plain_step, domain_step, args.compile_repeats, lambda: None)
        rows[name] = {"compiled_plain_ms": t_plain * 1e3, "compiled_domain_ms": t_domain * 1e3,
                      "compiled_domain_vs_compiled_plain": t_domain / t_plain,
                      "eager_plain_ms": e_plain * 1e3, "eager_domain_ms": e_domain * 1e3,
                      "compiled_vs_eager_domain": t_domain / e_domain, **domain_stats}
        print(f"  D=1 {name}: compiled domain {t_domain * 1e3:.2f} ms = {t_domain / t_plain:.3f}x compiled plain; "
              f"eager domain {e_domain * 1e3:.2f} ms; compile {domain_stats['compile_s']:.1f} s, "
              f"{domain_stats['graph_breaks']} graph breaks, {domain_stats['recompiles']} recompiles", flush=True)
    DistributedManager.shutdown()
    return rows


def _peak_growth_kb(step) -> int:
    base = rss_kb()
    reset_peak_rss()
    step()
    return peak_rss_kb() - base


def conv_norm_stack(channels: int, layers: int) -> nn.Module:
    """Convs with GroupNorm and GELU between them: the stack the issue's memory figure was measured on."""
    mods: list[nn.Module] = [nn.Conv2d(1, channels, 3, padding=1)]
    for _ in range(layers - 2):
        mods += [nn.GroupNorm(4, channels), nn.GELU(), nn.Conv2d(channels, channels, 3, padding=1)]
    mods += [nn.GroupNorm(4, channels), nn.GELU(), nn.Conv2d(channels, 1, 3, padding=1)]
    return nn.Sequential(*mods)


def _field(args) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    height, width = args.compile_field
    return conv_norm_stack(args.channels, args.layers), torch.randn(args.batch, 1, height, width)


class _AttentionBlock(nn.Module):
    """Pre-norm self-attention on a (B, S, C) token sequence, residual: the shape of a transformer's attention."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj = nn.LayerNorm(channels), nn.Linear(channels, 3 * channels), \
            nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c))


def _attention_rows(world: int, args) -> dict:
    """Two attention blocks on a sequence sharded over the domain, eager against compiled (mesh3d::sharded_sdpa)."""
    torch.manual_seed(0)
    model = nn.Sequential(_AttentionBlock(64, 4), _AttentionBlock(64, 4))
    x = torch.randn(args.batch, args.attention_tokens, 64)
    sizes = domain.balanced_sizes(x.shape[1], world)
    eager_step, compiled_step = _steps(model, lambda: domain.shard(x, dim=1, sizes=sizes), domain_input=True)
    stats: dict = {}
    eager_step()
    _first_call(compiled_step, stats)
    t_eager, t_compiled = paired_times(eager_step, compiled_step, args.compile_sharded_repeats, lambda: None)
    _after_timing(stats)
    return {f"attention_{k}": v for k, v in (("eager_ms", t_eager * 1e3), ("compiled_ms", t_compiled * 1e3),
                                             *stats.items())}


class _GridAttention(nn.Module):
    """Conv embedding, the grid flattened into tokens, 4-head self-attention over every token, back to the grid."""

    def __init__(self, channels: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.qkv, self.decode = nn.Conv2d(1, channels, 3, padding=1), nn.Linear(channels, 3 * channels), \
            nn.Conv2d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        b, c, grid = e.shape[0], e.shape[1], e.shape[2:]
        t = e.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).reshape(b, -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        return self.decode(t.transpose(1, 2).reshape(b, c, *grid))


def _token_grid_rank(rank: int, world: int, port: int, args, queue) -> None:
    """Row 6 on one rank of a 2x2 domain grid."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    DistributedManager.initialize(batch=1, domain=(2, 2))
    torch.manual_seed(0)
    model = _GridAttention()
    side = args.token_grid_side
    x = torch.randn(args.batch, 1, side, side)
    result = {}
    for mode in ("ring", "gather"):
        with domain.attention_mode(mode):
            eager_step, compiled_step = _steps(model, lambda: domain.shard(x, dims=(2, 3)), domain_input=True)
            stats: dict = {}
            eager_step()
            _first_call(compiled_step, stats)
            t_eager, t_compiled = paired_times(eager_step, compiled_step, args.compile_sharded_repeats, lambda: None)
            _after_timing(stats)
        result[mode] = {"eager_ms": t_eager * 1e3, "compiled_ms": t_compiled * 1e3, **stats}
    queue.put((rank, result))
    DistributedManager.shutdown()


def _token_grid(args) -> dict:
    per_rank = spawn_ranks(_token_grid_rank, 4, args, timeout=900)
    ranks = [per_rank[r] for r in range(4)]
    return {mode: {k: max(r[mode][k] for r in ranks) for k in ranks[0][mode]} for mode in ranks[0]}


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    DistributedManager.initialize(batch=1, domain=world)
    model, x = _field(args)
    sizes = domain.balanced_sizes(x.shape[2], world)

    eager_step, compiled_step = _steps(model, lambda: domain.shard(x, dim=2, sizes=sizes), domain_input=True)
    stats: dict = {}
    eager_step()
    _first_call(compiled_step, stats)
    compiled_step()
    result = {"eager_peak_kb": _peak_growth_kb(eager_step), "compiled_peak_kb": _peak_growth_kb(compiled_step)}
    t_eager, t_compiled = paired_times(eager_step, compiled_step, args.compile_sharded_repeats, lambda: None)
    _after_timing(stats)
    result.update(eager_ms=t_eager * 1e3, compiled_ms=t_compiled * 1e3, **stats)
    result.update(_attention_rows(world, args))
    queue.put((rank, result))
    DistributedManager.shutdown()


def _plain_peak_kb(args) -> int:
    model, x = _field(args)

    def step():
        (model(x) ** 2).mean().backward()

    step()
    return _peak_growth_kb(step)


def _sharded(args, world: int) -> dict:
    per_rank = spawn_ranks(_rank, world, args, timeout=900)
    ranks = [per_rank[r] for r in range(world)]
    return {"domain": world, "eager_ms": max(r["eager_ms"] for r in ranks),
            "compiled_ms": max(r["compiled_ms"] for r in ranks),
            "compile_s": max(r["compile_s"] for r in ranks),
            "graph_breaks": max(r["graph_breaks"] for r in ranks), "recompiles": max(r["recompiles"] for r in ranks),
            "eager_peak_kb": max(r["eager_peak_kb"] for r in ranks),
            "compiled_peak_kb": max(r["compiled_peak_kb"] for r in ranks),
            **{k: max(r[k] for r in ranks) for k in ranks[0] if k.startswith("attention_")}}


def part_compile(args) -> dict:
    """Every row above; ``args``: the ``add_arguments`` options and batch, channels, layers, domains."""
    report = {"one_rank": _one_rank(args), "sharded": []}
    plain_kb = _plain_peak_kb(args)
    report["plain_peak_kb"] = plain_kb
    for world in [d for d in args.domains if d > 1]:
        run = _sharded(args, world)
        run["compiled_vs_eager"] = run["compiled_ms"] / run["eager_ms"]
        run["eager_peak_vs_plain"] = run["eager_peak_kb"] / plain_kb
        run["compiled_peak_vs_plain"] = run["compiled_peak_kb"] / plain_kb
        report["sharded"].append(run)
        print(f"  D={world}: compiled {run['compiled_ms']:.1f} ms = {run['compiled_vs_eager']:.3f}x eager; compile "
              f"{run['compile_s']:.1f} s, {run['graph_breaks']} graph breaks, {run['recompiles']} recompiles; peak "
              f"memory per rank {run['eager_peak_vs_plain']:.2f}x (eager), {run['compiled_peak_vs_plain']:.2f}x "
              "(compiled) plain torch", flush=True)
        print(f"  D={world} attention ({args.attention_tokens} tokens): compiled {run['attention_compiled_ms']:.1f} ms, "
              f"eager {run['attention_eager_ms']:.1f} ms; {run['attention_graph_breaks']} graph breaks, "
              f"{run['attention_recompiles']} recompiles", flush=True)
    if 4 in args.domains:
        report["token_grid"] = _token_grid(args)
        for mode, row in report["token_grid"].items():
            print(f"  D=4 (2x2 grid) token-grid attention, {args.token_grid_side}x{args.token_grid_side} field, {mode}: "
                  f"compiled {row['compiled_ms']:.1f} ms, eager {row['eager_ms']:.1f} ms; {row['graph_breaks']} graph "
                  f"breaks, {row['recompiles']} recompiles", flush=True)
    return report


def plot_compile(report: dict, path: Path) -> None:
    """Three panels: D=1 compiled domain / compiled plain (goal 1.05), compiled / eager at D>1, peak memory per rank
    over plain torch at D>1 (goal 0.55 at D=2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    names = list(report["one_rank"])
    axes[0].barh(names, [report["one_rank"][n]["compiled_domain_vs_compiled_plain"] for n in names])
    axes[0].axvline(1.05, color="red", linestyle="--", label="goal 1.05")
    axes[0].set_xlabel("D=1: compiled domain / compiled plain torch")
    axes[0].legend(loc="lower right")
    runs = report["sharded"]
    labels = [f"D={r['domain']}" for r in runs]
    axes[1].bar(labels, [r["compiled_vs_eager"] for r in runs])
    axes[1].axhline(1.0, color="grey", linestyle="--")
    axes[1].set_ylabel("step time: compiled / eager (domain)")
    width = 0.38
    at = list(range(len(runs)))
    axes[2].bar([i - width / 2 for i in at], [r["eager_peak_vs_plain"] for r in runs], width, label="eager")
    axes[2].bar([i + width / 2 for i in at], [r["compiled_peak_vs_plain"] for r in runs], width, label="compiled")
    axes[2].axhline(0.55, color="red", linestyle="--", label="goal at D=2: 0.55")
    axes[2].set_xticks(at, labels)
    axes[2].set_ylabel("peak RSS growth per rank / plain torch")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This part's options (``bench_domain.py`` shares ``batch``, ``channels``, ``layers`` and ``domains``)."""
    parser.add_argument("--compile-small", type=int, default=48, help="the small conv stack's field (D=1)")
    parser.add_argument("--compile-unet", type=int, default=64, help="the U-Net's field (D=1)")
    parser.add_argument("--compile-repeats", type=int, default=300,
                        help="timed steps per row (D=1; 20 left the small stack's ratio 2%% apart between runs)")
    parser.add_argument("--compile-field", type=int, nargs=2, default=[1024, 512], metavar=("H", "W"),
                        help="the conv/GroupNorm stack's field at D>1 (sharded along H)")
    parser.add_argument("--compile-sharded-repeats", type=int, default=3, help="timed steps per row (D>1)")
    parser.add_argument("--attention-tokens", type=int, default=2048, help="the attention rows' sequence (D>1)")
    parser.add_argument("--token-grid-side", type=int, default=40, help="the token-grid rows' field side (D=4 grid)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--domains", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.compile_field, args.compile_repeats, args.compile_unet, args.attention_tokens = [128, 64], 3, 32, 256
        args.token_grid_side = 16
    torch.set_num_threads(1)
    report = part_compile(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        plot_compile(report, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
