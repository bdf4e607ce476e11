"""The domain-axis sections of docs/benchmarks.md (``scripts/bench_report.py`` calls ``domain_sections``).

Usage::

    lines: list[str] = []
    domain_sections(lines)  # slabs, compile, blocks (with halo rounds), attention
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import BENCH, load_bench_json as _load  # noqa: E402

__all__ = ["domain_sections"]


def domain_sections(lines: list[str]) -> None:
    """Append the slab, compile, block and attention sections, in the page's order."""
    _domain(lines)
    _compile(lines)
    _blocks(lines)
    _attention(lines)


def _domain(lines: list[str]) -> None:
    d = _load("domain.json")
    if not d:
        return
    c = d["config"]
    lines += ["## Domain parallelism", ""]
    if "ops" in d:
        unet = d["ops"]["U-Net step"]
        lines += [f"`scripts/bench_domain.py`, one rank ({c.get('device_name', 'cpu')}, one thread): forward+backward of "
                  "each op on a domain tensor at `domain=1` over the same op on the plain tensor, the two run call by "
                  f"call, median of {c['rounds'] * c['repeats']}. Goal for the whole U-Net step: <= 1.05 "
                  f"(measured {unet['slowdown']:.3f}).", "",
                  "| op | plain torch | domain=1 / plain |", "|---|---|---|"]
        lines += [f"| {name} | {r['plain_s'] * 1e3:.2f} ms | {r['slowdown']:.3f} |" for name, r in d["ops"].items()]
        lines.append("")
    if "dispatch" in d:
        _dispatch(lines, d["dispatch"], c)
    if "scaling" in d:
        lines += [f"Strong scaling: {c['layers']} 3x3 convs, {c['channels']} channels, a {c['batch']}x1x{c['size']}x"
                  f"{c['size']} field, D processes with one thread each on {c['cpu_count']} cores (D > cores is "
                  "oversubscribed). Goal: D=2 at least 1.8x faster than D=1. *Inside exchanges*: the share of the "
                  "step spent posting and waiting on halo messages (it includes waiting for a slower rank); "
                  "*transfers*: one exchange round timed alone with the ranks started together, times the rounds "
                  "per step (a rough estimate of the message cost itself; it can exceed the in-step share).", "",
                  "| D | speedup vs D=1 | time / plain torch | bytes / min halo | inside exchanges | transfers | "
                  "activation per rank / plain | peak RSS per rank / plain |", "|---|---|---|---|---|---|---|---|"]
        for r in d["scaling"]:
            halo = "-" if r["domain"] == 1 else f"{r['bytes_vs_halo']:.2f}"
            rss = "-" if r.get("peak_rss_vs_plain_torch") is None else f"{r['peak_rss_vs_plain_torch']:.2f}"
            lines.append(f"| {r['domain']} | {r['speedup_vs_one_rank']:.2f} | {r['time_vs_plain_torch']:.2f} | {halo} | "
                         f"{r['exchange_fraction']:.1%} | {r.get('transfer_fraction', 0.0):.1%} | "
                         f"{r['activation_vs_plain_torch']:.2f} | {rss} |")
        lines += ["", "`full_tensor` of 10^6 rows x 1 column (goal: under 5 ms of Python): "
                  + ", ".join(f"D={r['domain']}: {r['full_tensor_1e6_ms']:.2f} ms in all, of which planning "
                              f"{r['full_tensor_1e6_planning_ms'] * 1e3:.0f} us" for r in d["scaling"]
                              if "full_tensor_1e6_ms" in r) + "."]
    if "overlap" in d:
        o = d["overlap"]
        lines += ["", f"Overlap at D=2 ({c['channels']} channels, a {c['batch']}x{c['size']}x{c['size']} field), all "
                  "contenders in one run, call by call with the ranks in step. One 3x3 conv forward: mesh3d with "
                  f"overlap {o['mesh3d'] * 1e3:.2f} ms, without it (`domain.window_overlap(False)`) "
                  f"{o['mesh3d_no_overlap'] * 1e3:.2f} ms ({o['overlap_vs_no_overlap']:.2f}x), the same overlap "
                  f"written by hand {o['by_hand'] * 1e3:.2f} ms, the kernel alone on the shard with no exchange "
                  f"{o['kernel_only'] * 1e3:.2f} ms. The conv stack's forward+backward step: {o['step'] * 1e3:.1f} ms "
                  f"with overlap, {o['step_no_overlap'] * 1e3:.1f} ms without ({o['step_overlap_vs_no_overlap']:.2f}x), "
                  f"plain torch on the shard alone {o['step_kernel_only'] * 1e3:.1f} ms. Overlap is on by default; "
                  "what separates it from the hand-written one is the header round that checks the ranks agree "
                  "(divergence detection) and the strips' small copies."]
    if (BENCH / "domain.png").exists():
        lines += ["", "![domain](benchmarks/domain.png)"]
    lines.append("")


def _dispatch(lines: list[str], d: dict, c: dict) -> None:
    """The host cost per op on a tiny tensor (``bench_domain_dispatch.py``): a table where the run measured the
    dispatcher's walk and DTensor too, else the one line of older runs."""
    ops = {k: v for k, v in d.items() if "overhead_us" in v}
    ft = d["full_tensor 1e6 rows"]
    journal = d.get("journal record (multi-rank only)", {}).get("us")
    goals = "goals: <= 8 us for element-wise and view ops, <= 12 us for a convolution, over plain torch"
    tail = ((f" On a multi-rank domain a layout-changing op also pays {journal:.1f} us for the divergence journal."
             if journal is not None else "")
            + f" `full_tensor` of 10^6 rows at one rank: {ft['total_ms']:.3f} ms in all (goal: under 5 ms of Python; a "
            f"plain copy of the same shard takes {ft['copy_ms']:.3f} ms).")
    if not all("full_dispatcher_us" in v for v in ops.values()):
        lines += [f"Python dispatch cost per op on a 1x2x4x4 tensor ({goals}): "
                  + ", ".join(f"{k} {v['overhead_us']:.1f} us" for k, v in ops.items()) + "." + tail, ""]
        return
    c = d.get("measured_on", c)
    us = lambda v: "-" if v is None else f"{v:.1f} us"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    lines += [f"Host cost per op on a 1x2x4x4 tensor ({c.get('cpu', 'cpu')}, torch {c.get('torch', '?')}, one thread), "
              f"{c['dispatch_calls']} calls a loop, the best of "
              f"{c.get('dispatch_rounds', 3)} rounds taken in turns ({goals}). *Kept*: a domain tensor at domain=1 as "
              "it runs (the wrapper subclass; a call whose signature was seen answered from what its first call's rule "
              "gave, element-wise ops of one layout from their operands' metadata); *walk*: the same with kept answers "
              "off, every call through the dispatcher's walk and its rule; DTensor: sharded the same way on a one-rank "
              "gloo mesh (- where it has no rule for the op's arguments); the storage subclass (private) takes the "
              "walk on every call.", "",
              "| op | plain torch | kept | over plain | walk | over plain | DTensor | kept / DTensor | storage subclass |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, v in ops.items():
        wrapper = v.get("wrapper_us")
        lines.append(f"| {name} | {us(v['plain_us'])} | {us(wrapper)} | "
                     f"{us(None if wrapper is None else wrapper - v['plain_us'])} | "
                     f"{us(v['full_dispatcher_us'])} | {us(v['full_dispatcher_us'] - v['plain_us'])} | "
                     f"{us(v['dtensor_us'])} | {ratio(wrapper, v['dtensor_us'])} | {us(v['domain_us'])} |")
    lines += ["", tail.strip(), ""]


def _compile(lines: list[str]) -> None:
    d = _load("domain_compile.json")
    if not d:
        return
    c = d["config"]
    lines += ["## torch.compile on domain tensors", "",
              f"`scripts/bench_domain.py --parts compile` (`scripts/bench_compile.py`), {c.get('cpu', c.get('device_name'))}"
              f", {c['cpu_count']} cores, one thread per rank (D=4 oversubscribes 2 cores)."
              " Each compiled step is `torch.compile` of the model and loss, the input sharded and "
              "the backward run outside it; a row and its alternative run alternately, call by call, in the same "
              "process. Compile time is the first call's wall time (Dynamo, AOTAutograd and Inductor; the Inductor cache "
              "is warm for shapes another row compiled first). Graph breaks and recompiles are Dynamo's counters; a "
              "recompile is a graph compiled after the first step. Goal: at D=1 at most 1.05x the compiled plain step "
              "with 0 graph breaks.", "",
              "| D=1 | compiled plain | compiled domain | ratio | eager domain | compile | graph breaks | recompiles |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in d["one_rank"].items():
        lines.append(f"| {name} | {r['compiled_plain_ms']:.2f} ms | {r['compiled_domain_ms']:.2f} ms | "
                     f"{r['compiled_domain_vs_compiled_plain']:.3f} | {r['eager_domain_ms']:.2f} ms | "
                     f"{r['compile_s']:.1f} s | {r['graph_breaks']} | {r['recompiles']} |")
    field = "x".join(str(n) for n in c.get("compile_field", (c["size"], c["size"])))
    lines += ["", f"A {c['layers']}-conv stack with GroupNorm on a {c['batch']}x1x{field} field over D ranks (the largest "
              "rank's figures). Peak memory is the peak RSS growth over one forward+backward per rank, over plain torch "
              "in one process (goal at D=2: at most 0.55).", "",
              "| D | eager | compiled | compiled / eager | compile | graph breaks | recompiles | peak / plain, eager | "
              "peak / plain, compiled |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["sharded"]:
        lines.append(f"| {r['domain']} | {r['eager_ms']:.1f} ms | {r['compiled_ms']:.1f} ms | {r['compiled_vs_eager']:.3f} | "
                     f"{r['compile_s']:.1f} s | {r['graph_breaks']} | {r['recompiles']} | {r['eager_peak_vs_plain']:.2f} | "
                     f"{r['compiled_peak_vs_plain']:.2f} |")
    attention = [r for r in d["sharded"] if "attention_compiled_ms" in r]
    if attention:
        lines += ["", f"Two pre-norm self-attention blocks (64 channels, 4 heads) on a {c.get('attention_tokens')}-token "
                  "sequence sharded over D ranks, compiled (the attention is one custom op in the graph, "
                  "`mesh3d::sharded_sdpa`, its forward recomputed in backward) against eager:", "",
                  "| D | eager | compiled | compiled / eager | compile | graph breaks | recompiles |", "|---|---|---|---|---|---|---|",
                  *(f"| {r['domain']} | {r['attention_eager_ms']:.1f} ms | {r['attention_compiled_ms']:.1f} ms | "
                    f"{r['attention_compiled_ms'] / r['attention_eager_ms']:.3f} | {r['attention_compile_s']:.1f} s | "
                    f"{r['attention_graph_breaks']} | {r['attention_recompiles']} |" for r in attention)]
    grid = d.get("token_grid")
    if grid:
        side = c.get("token_grid_side")
        lines += ["", f"A {side}x{side} field on a 2x2 grid of blocks (D=4) flattened into a token grid, 4-head "
                  "self-attention over every token (the same custom op, the grid's layout in its key), compiled against "
                  "eager in two attention modes:", "",
                  "| mode | eager | compiled | compiled / eager | compile | graph breaks | recompiles |",
                  "|---|---|---|---|---|---|---|",
                  *(f"| {mode} | {r['eager_ms']:.1f} ms | {r['compiled_ms']:.1f} ms | {r['compiled_ms'] / r['eager_ms']:.3f} | "
                    f"{r['compile_s']:.1f} s | {r['graph_breaks']} | {r['recompiles']} |" for mode, r in grid.items())]
    if (BENCH / "domain_compile.png").exists():
        lines += ["", "![compile](benchmarks/domain_compile.png)"]
    lines.append("")


def _blocks(lines: list[str]) -> None:
    d = _load("domain_blocks.json")
    if not d:
        return
    c, sl, bl, r = d["config"], d["slabs"], d["blocks"], d["blocks_vs_slabs"]
    lines += ["## Blocks vs slabs", "",
              f"`scripts/bench_blocks.py`: the same {c['layers']}-conv stack ({c['channels']} channels, 3x3 'same') on a "
              f"{c['batch']}x1x{c['size']}x{c['size']} field over D={c['domain']} domain ranks, as a 2x2 grid of blocks "
              f"and as {c['domain']} slabs; one thread per rank on {c['cpu_count']} cores ({c.get('cpu', 'CPU not recorded')}; "
              "oversubscribed), best of "
              f"{c['rounds']} alternating runs of {c['steps']} steps. Halo bytes: forward and backward, the worst rank, "
              "against the geometric minimum (the other ranks' elements its windows read, per conv).", "",
              "| layout | step time | halo bytes per rank | / geometric minimum | activation per rank |",
              "|---|---|---|---|---|"]
    rows = [("4 slabs", sl), ("2x2 blocks", bl)] + ([("2x2 blocks, overlap on", d["blocks_overlap"])]
                                                   if "blocks_overlap" in d else [])
    for name, x in rows:
        lines.append(f"| {name} | {x['step_time_s'] * 1e3:.1f} ms | {x['max_rank_bytes'] / 1e3:.1f} kB | "
                     f"{x['bytes_vs_min']:.3f} | {x['max_rank_activation_bytes'] / 1e6:.1f} MB |")
    lines += ["", f"Blocks / slabs: step time {r['step_time']:.2f}, halo bytes per rank {r['halo_bytes_per_rank']:.2f}, "
              f"activation per rank {r['activation_per_rank']:.2f}. Both layouts send exactly the minimum; blocks send "
              "half as much per rank at D=4 (the face shrinks as sqrt(D)) but three messages per window op instead of "
              "one or two (the corner is a message of its own), and a CPU with fast local messages gains little from "
              "the bytes saved."]
    if "overlap_vs_default" in d:
        o = d["overlap_vs_default"]
        lines += ["", f"Blocks with the halo/compute overlap (`domain.window_overlap(True)`) / without (the default on "
                  f"blocks): step time {o['step_time']:.2f}, halo bytes per rank {o['halo_bytes_per_rank']:.2f} (the "
                  "same rows travel). With 4 ranks on 2 cores no core is idle while messages travel, so the extra "
                  "exchange round per grid dim and the strip kernels are pure cost here; hence off by default."]
    lines += ["", "![blocks](benchmarks/domain_blocks.png)", ""]
    _halo_rounds(lines)


def _halo_rounds(lines: list[str]) -> None:
    d = _load("halo_rounds.json")
    if not d:
        return
    c = d["config"]
    lines += ["### Halos on blocks: one round, or one pass per grid dim", "",
              f"`scripts/bench_halo_rounds.py`: a 3x3 'same' window's halo on a 2x2 grid ({c['channels']} channels, "
              f"fp32; each rank needs a row, a column and a corner), median of {c['iters']} exchanges, the worst rank; "
              f"one thread per rank on {c['cpu_count']} cores ({c.get('cpu', 'CPU not recorded')}). "
              "`mesh3d` is `blocks.extend_windows` as it runs (a "
              "header round, then every neighbour's box in one `batch_isend_irecv`); `mesh3d per dim` the same call "
              "with blocks overlap on, where it goes one grid dim after the other (a header round and a pass per dim); "
              "`by hand` the two patterns as bare `batch_isend_irecv` calls without header rounds: the floors.", "",
              "| block | halo bytes | mesh3d | mesh3d per dim | by hand per dim | by hand one round | "
              "mesh3d / mesh3d per dim | mesh3d / by hand one round |", "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['side']}x{r['side']} | {r['halo_bytes_per_rank'] / 1e3:.1f} kB | {r['mesh3d_s'] * 1e3:.2f} ms "
                     f"| {r['mesh3d_per_dim_s'] * 1e3:.2f} ms | {r['per_dim_s'] * 1e3:.2f} ms | "
                     f"{r['all_at_once_s'] * 1e3:.2f} ms | {r['mesh3d_vs_mesh3d_per_dim']:.2f} | "
                     f"{r['mesh3d_vs_all_at_once']:.2f} |")
    lines += ["", "One round is faster at every size: half the rounds (each a synchronisation of oversubscribed ranks) "
              "and, for large blocks, one copy of the block into the extended buffer instead of one per pass (the "
              "second pass copies the first's result again). The bytes are the same. What remains above the floor at "
              "small blocks is the header round that lets every exchange detect diverged ranks instead of hanging, "
              "and Python planning; it vanishes at large blocks. So window ops, transposed convolutions, `F.pad` and "
              "upsampling on blocks use one round; the per-dim scheme remains where the overlap nests one grid line "
              "inside another, and where resampling between passes shrinks what the next sends (downsampling, "
              "adaptive pooling).", "",
              "![halo rounds](benchmarks/halo_rounds.png)", ""]


def _attention(lines: list[str]) -> None:
    d = _load("attention.json")
    if not d:
        return
    c, r = d["config"], d["ratios"]
    load = c.get("load_average_1_5_15_min_at_end")
    lines += ["## Attention over the domain: ring, gather, Ulysses", "",
              f"`scripts/bench_attention.py`: one forward+backward of `F.scaled_dot_product_attention` on S={c['seq']} "
              f"tokens, {c['heads']} heads of {c['head_dim']}, {c['dtype']}, q/k/v built on each rank for its own rows; "
              f"D processes with one thread each on {c['cpu_count']} cores ({c.get('cpu', 'CPU not recorded')}); D=1 is "
              "torch's SDPA in one process. Peak: RSS growth of the step (VmHWM), the worst rank. Step: median wall "
              "time of the slowest rank; compute: its main thread's CPU time (what a core per rank would take)"
              + (f"; load average {load[0]:.0f} on the machine at the end of the run" if load else "") + ".", "",
              "| D | mode | peak growth per rank | step | compute (slowest rank) | K/V in flight |",
              "|---|---|---|---|---|---|"]
    for row in (x for x in d["rows"] if x["phase"] == "modes"):
        flight = f"{row['in_flight_blocks']:.2f} blocks" if row.get("in_flight_blocks") else "-"
        lines.append(f"| {row['domain']} | {row['mode'] if row['domain'] > 1 else 'torch SDPA'} | "
                     f"{row['peak_growth_mb']:.0f} MB | {row['step_s']:.2f} s | {row['cpu_s_max']:.2f} s | {flight} |")
    weak = {(x["mode"], x["domain"]): x["peak_growth_mb"] for x in d["rows"] if x["phase"] == "weak"}
    causal = {x["balance"]: x["peak_growth_mb"] for x in d["rows"] if x["phase"] == "causal"}
    lines += ["", f"Peak growth per rank at D=4 / D=1 (goal for the ring: <= 0.35): ring "
              f"{r['peak_ring_d4_over_d1']:.2f}, Ulysses {r['peak_ulysses_d4_over_d1']:.2f}, gather "
              f"{r['peak_gather_d4_over_d1']:.2f}. The ring's default head groups (8) against one group (all heads per "
              f"block): {1 / r['ring_head_groups_1_peak_over_default_d4']:.2f}x the peak. K/V held in transit by the "
              f"ring: at most {r['ring_in_flight_blocks_max']:.2f} blocks (this rank's keys and values of a head group).",
              "", f"S and D doubling together (S = {c['seq'] // 4} x D), peak growth per rank at D = 1, 2, 4: ring "
              + ", ".join(f"{weak[('ring', k)]:.0f}" for k in (1, 2, 4)) + " MB; gather "
              + ", ".join(f"{weak[('gather', k)]:.0f}" for k in (1, 2, 4)) + " MB.", "",
              f"Causal (`is_causal`, D=4): (query, key) pairs per rank, max / mean: "
              f"{r['causal_work_max_over_mean_zigzag']:.3f} in the zigzag layout against "
              f"{r['causal_work_max_over_mean_contiguous']:.3f} on contiguous slabs (goal <= 1.05); compute of the "
              f"slowest rank, zigzag / contiguous {r['causal_cpu_max_zigzag_over_contiguous']:.2f} (max/mean "
              f"{r['causal_cpu_max_over_mean_zigzag']:.2f} against {r['causal_cpu_max_over_mean_contiguous']:.2f}); "
              f"wall step, zigzag / contiguous {r['causal_step_zigzag_over_contiguous']:.2f} (4 ranks on 2 cores: the "
              "total compute, not the slowest rank's, sets the wall time here). Peak growth per rank, zigzag / "
              f"contiguous: {causal[True]:.0f} / {causal[False]:.0f} MB (the per-call relayout of q, k, v and the "
              "output).", "",
              "Wall times come from a machine shared with other work: the ring's exchange rounds (one or two per step "
              "and head group) each wait for every rank to be scheduled, so its wall time moves most; the compute column does "
              "not depend on that.", "",
              "Ring / gather at D=4 by sequence length (compute of the slowest rank; wall step): "
              + ", ".join(f"S={s}: {v:.2f}; {r['crossover_d4_step_ring_over_gather'][s]:.2f}"
                          for s, v in r["crossover_d4_cpu_ring_over_gather"].items()) + "."]
    if (BENCH / "attention.png").exists():
        lines += ["", "![attention](benchmarks/attention.png)"]
    lines.append("")
