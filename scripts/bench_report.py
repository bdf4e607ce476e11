#!/usr/bin/env python
"""Write docs/benchmarks.md from the JSON files the benchmark scripts left in docs/benchmarks/.

Usage::

    python scripts/bench_report.py          # scripts/bench_all.sh runs it last

Every figure is a ratio against the alternative measured in the same run, so the page states
the machine the files came from but compares nothing across machines.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"


def _load(name: str) -> dict | None:
    path = BENCH / name
    return json.loads(path.read_text()) if path.exists() else None


def _parallelize(lines: list[str]) -> None:
    lines += ["## parallelize vs the same transforms written by hand", "",
              "`scripts/bench_parallelize.py`: one AdamW step of a 4-layer transformer, `parallelize(model, plan)` vs "
              "`parallelize_module` + `fully_shard` written by hand, median step time and peak RSS growth, "
              "both build orders (the model built first runs slower either way; the ratio is their geometric mean). "
              "Goal: <= 1.03 each.", "",
              "| run | step time ratio (mesh3d / by hand) | peak memory ratio |", "|---|---|---|"]
    for name in ("parallelize.json", "parallelize_8ranks.json"):
        d = _load(name)
        if d:
            c = d["config"]
            by_order = d["step_time_ratio_by_build_order"]
            lines.append(f"| {c['nproc']} ranks (batch {c['batch']} x model {c['model']}), {c['rounds']} rounds | "
                         f"{d['step_time_ratio']:.2f} ({by_order['mesh3d_built_first']:.2f} / "
                         f"{by_order['manual_built_first']:.2f}) | {d['peak_memory_ratio']:.2f} |")
    for png in ("parallelize.png", "parallelize_8ranks.png"):
        if (BENCH / png).exists():
            lines += ["", f"![{png}](benchmarks/{png})"]
    lines.append("")


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
        ops = {k: v for k, v in d["dispatch"].items() if "overhead_us" in v}
        worst = max(ops.values(), key=lambda v: v["overhead_us"])["overhead_us"]
        ft = d["dispatch"]["full_tensor 1e6 rows"]
        journal = d["dispatch"].get("journal record (multi-rank only)", {}).get("us")
        lines += [f"Python dispatch cost per op on a 1x2x4x4 tensor (goal <= 30 us; worst {worst:.1f} us"
                  + (f"; on a multi-rank domain a layout-changing op also pays {journal:.1f} us for the divergence "
                     "journal" if journal is not None else "") + "): "
                  + ", ".join(f"{k} {v['overhead_us']:.1f} us" for k, v in ops.items())
                  + f". `full_tensor` of 10^6 rows at one rank: {ft['total_ms']:.3f} ms in all (goal: under 5 ms of "
                  f"Python; a plain copy of the same shard takes {ft['copy_ms']:.3f} ms).", ""]
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


def _checkpoint(lines: list[str]) -> None:
    d = _load("checkpoint.json")
    if not d:
        return
    s, r, co = d["seconds"], d["ratios"], d["coalesce"]
    lines += ["## Checkpoints", "",
              f"`scripts/bench_checkpoint.py`: {d['config']['ranks']} ranks, {d['config']['state_bytes'] / 1e9:.2f} GB of "
              "FSDP-sharded fp32 state, best of 3 per phase, warm page cache, every save fsynced. Ratios are DCP's "
              "time / mesh3d's time (> 1: mesh3d faster). Goals: save >= 1.2, load >= 1.0, read amplification <= 1.05.",
              "", "| phase | mesh3d | torch.distributed.checkpoint | ratio |", "|---|---|---|---|",
              f"| save | {s['save_mesh3d']:.2f} s | {s['save_dcp']:.2f} s | {r['save_mesh3d_vs_dcp']:.2f} |",
              f"| load, same mesh | {s['load_mesh3d']:.2f} s | {s['load_dcp']:.2f} s | {r['load_mesh3d_vs_dcp_same_mesh']:.2f} |",
              f"| load, FSDP(4) -> HSDP(2x2) | {s['reshard_load_mesh3d']:.2f} s | {s['reshard_load_dcp']:.2f} s | "
              f"{r['load_mesh3d_vs_dcp_resharded']:.2f} |",
              f"| load, same mesh, all or nothing | {s['load_mesh3d_all_or_nothing']:.2f} s | {s['load_dcp']:.2f} s | "
              f"{r['load_mesh3d_all_or_nothing_vs_dcp_same_mesh']:.2f} |", "",
              f"Read amplification: {d['read_amplification']['same_mesh']:.2f} (same mesh), "
              f"{d['read_amplification']['resharded_fsdp4_to_hsdp2x2']:.2f} (resharded). Raw `safetensors.save_file` "
              f"of each rank's shards: {s['save_safetensors_raw']:.2f} s. Coalesce to one `model.safetensors`: "
              f"{co['gb_s']:.2f} GB/s, peak RSS {co['peak_minus_imports_mb']:.0f} MB above the process after imports "
              f"(largest tensor {co['largest_tensor_mb']:.0f} MB; goal: largest tensor + 256 MB)."]
    if (BENCH / "checkpoint.png").exists():
        lines += ["", "![checkpoint](benchmarks/checkpoint.png)"]
    lines.append("")


def _pretrained(lines: list[str]) -> None:
    d = _load("pretrained.json")
    if not d:
        return
    c, s, m = d["config"], d["seconds"], d["peak_extra_rss_mb_max_rank"]
    owned = max(r["owned_mb"] for r in d["per_rank"]["mesh3d"])
    largest = max(r["largest_owned_slice_mb"] for r in d["per_rank"]["mesh3d"])
    buffer = max(r["read_buffer_mb"] for r in d["per_rank"]["mesh3d_cast"])
    lines += ["## Loading pretrained weights", "",
              f"`scripts/bench_pretrained.py`: one HF-style `model.safetensors` of {c['file_bytes_fp32'] / 1e9:.2f} GB "
              f"(fp32 Linear layers) into a model FSDP-sharded over {c['ranks']} gloo ranks (each owns {owned:.0f} MB, "
              f"largest slice {largest:.1f} MB); `checkpoint.load_pretrained` vs DCP's `HuggingFaceStorageReader` "
              "(`dcp.load` + `set_model_state_dict`) on the same file. Time: best of 3, warm page cache. Peak extra "
              "RSS: the first load in a fresh process, max over ranks. Goal: peak extra RSS per rank <= largest owned "
              f"slice + read buffer. Machine: {c.get('cpu', 'not recorded')}, {c['cpu_count']} cores ({c['note']}).", "",
              "| contender | time | peak extra RSS per rank |", "|---|---|---|",
              f"| mesh3d, fp32 file -> fp32 model | {s['mesh3d']:.3f} s | {m['mesh3d']:.1f} MB |",
              f"| mesh3d, bf16 file -> fp32 model (`dtype=torch.float32`, read buffer {buffer:.1f} MB) | "
              f"{s['mesh3d_cast']:.3f} s | {m['mesh3d_cast']:.1f} MB |",
              f"| DCP `HuggingFaceStorageReader`, fp32 file | {s['dcp_hf']:.3f} s | {m['dcp_hf']:.1f} MB |", "",
              f"DCP time / mesh3d time: {d['ratios']['time_dcp_over_mesh3d']:.2f}. Goal met on every rank: "
              f"{'yes' if d['goal_peak_extra_within_largest_slice_plus_buffer'] else 'NO'}; the loaded weights equal "
              f"DCP's: {'yes' if d['same_weights_as_dcp'] else 'NO'}.", ""]


def _or_blank(seconds: dict, name: str) -> str:
    """``seconds[name]`` as ``0.123 s``, or "" where an older report has no such figure."""
    value = seconds.get(name)
    return "" if value is None else f"{value:.3f} s"


def _checkpoint_async(lines: list[str]) -> None:
    d = _load("checkpoint_async.json")
    if not d:
        return
    s, r, c = d["seconds"], d["ratios"], d["config"]
    best = c["note"].split(";")[1].strip() if ";" in c["note"] else "best of 3"
    load = c.get("load_average_1_5_15_min_at_end")
    lines += ["## Saving without stopping", "",
              f"`scripts/bench_checkpoint.py --async-only`: {c['ranks']} ranks, "
              f"{c['state_bytes'] / 1e9:.2f} GB of FSDP-sharded fp32 state, {best}. Blocked: from the call "
              "until it returns to the training loop (slowest rank); durable: until the checkpoint is committed. DCP runs "
              "its thread executor on its own gloo group, with its default stager (made per call) and with one stager "
              "kept across saves (it reuses its CPU copy). The copy floor is each rank copying the bytes it writes into "
              "a reused buffer and nothing else. Goals: mesh3d blocked <= 0.2 x mesh3d's synchronous save, "
              "and <= DCP's blocked time."
              + (f" Load average at the end of the run: {load[0]:.1f} on {c['cpu_count']} cores." if load else ""), "",
              "| | blocked, first call | blocked, steady (best) | blocked, steady (median) | durable after (best) |",
              "|---|---|---|---|---|",
              *(f"| {label} | {_or_blank(s, f'async_first_block_{key}')} | {s[f'async_block_{key}']:.3f} s | "
                f"{_or_blank(s, f'async_block_median_{key}')} | {s[f'async_durable_{key}']:.2f} s |"
                for label, key in (("mesh3d `async_save`", "mesh3d"), ("DCP `async_save`, default stager", "dcp"),
                                   ("DCP `async_save`, stager kept", "dcp_kept_stager"))),
              f"| mesh3d `save` (synchronous) | | {s['save_mesh3d']:.3f} s | | {s['save_mesh3d']:.2f} s |"]
    if "copy_floor_torch" in s:
        lines += [f"| copy floor, `Tensor.copy_` | | {s['copy_floor_torch']:.3f} s | | |",
                  f"| copy floor, `memmove` | | {s['copy_floor_memmove']:.3f} s | | |"]
    small = _load("checkpoint_async_256mb.json")
    if small:
        t = small["seconds"]
        lines += ["", f"The same at {small['config']['state_bytes'] / 1e9:.2f} GB (`--size-mb 256 --async-json "
                  "checkpoint_async_256mb.json`), blocked, first call / steady best / steady median: "
                  + "; ".join(f"{label} {_or_blank(t, f'async_first_block_{key}')} / {t[f'async_block_{key}']:.3f} s / "
                              f"{_or_blank(t, f'async_block_median_{key}')}"
                              for label, key in (("mesh3d", "mesh3d"), ("DCP", "dcp"), ("DCP stager kept", "dcp_kept_stager")))
                  + "."]
    lines += ["", "First calls (both sizes) are each contender's first background save in a fresh job of 4 ranks, after "
              "the same two training steps, the median of several jobs with the contenders taking turns (jobs: "
              + "; ".join(f"{name} " + ", ".join(f"{v:.3f}" for v in jobs)
                          for name, jobs in d.get("first_call_jobs_seconds", {}).items())
              + " s at the larger size). Timed one after another in one process, a later contender would find pages an "
              "earlier one freed still on glibc's heap and skip most page faults: the order, not the contender, "
              "would decide. Most of a first call is faulting in fresh pages for the host copy (about 0.45 ms per MB "
              "alone, twice that with 4 ranks on 2 cores), which every contender pays."]
    lines += ["", f"mesh3d blocked / synchronous save: {r['async_block_vs_sync_save']:.2f}; mesh3d blocked / DCP's best "
              f"blocked: {r['async_block_vs_best_dcp_async_block']:.2f}"
              + (f"; median, mesh3d / DCP's best median: {r['async_block_median_vs_best_dcp_median']:.2f}"
                 if "async_block_median_vs_best_dcp_median" in r else "")
              + (f"; first call, mesh3d / DCP's best first call: {r['async_first_block_vs_best_dcp_first_block']:.2f}"
                 if "async_first_block_vs_best_dcp_first_block" in r else "") + "; durable, mesh3d / DCP's best: "
              f"{r['async_durable_vs_dcp_async_durable']:.2f}"
              + (f"; copy floor (`copy_`, `memmove`) / synchronous save: {r['copy_floor_torch_vs_sync_save']:.2f}, "
                 f"{r['copy_floor_memmove_vs_sync_save']:.2f}" if "copy_floor_torch_vs_sync_save" in r else "") + ". "
              "The contenders take turns, one save each per round, so the machine's other load falls on all alike. "
              "A repeat `async_save` of an unchanged structure blocks for the state dict and one copy of the bytes "
              "this rank writes into the kept host buffer (with `Tensor.copy_` or `memmove`, whichever its earlier "
              "saves timed faster on this machine: neither wins in every session), while one all-gather of five int64 confirms that the boxes "
              "agreed at the first save still hold; checksums, writes and the commit run on the writer thread. On CPU that copy is needed "
              "(the optimizer changes parameters in place) and is most of the blocked time, while a synchronous save to "
              "the page cache is little more than the same copy plus checksums and fsync: the ratio to the synchronous "
              "save is bounded by the copy floor here, and falls with slower storage or device-resident state (whose "
              "copies are queued on the stream without blocking; not measured here: this machine has no GPU). Ranks "
              "share 2 cores, so under other load these figures move by tens of percent between runs.", ""]


def _lightning(lines: list[str]) -> None:
    d = _load("lightning.json")
    if not d:
        return
    c = d["config"]
    lines += ["## Lightning: MeshStrategy vs ModelParallelStrategy", "",
              f"`scripts/bench_lightning.py`: the same LightningModule (a {c['layers']}-layer transformer, dim {c['dim']}) "
              f"fit on {c['ranks']} CPU ranks ({c['mesh']}) started by Lightning's launcher, `MeshStrategy` with one "
              "`Plan` vs Lightning's `ModelParallelStrategy` with the module's hand-written `parallelize_module` + "
              f"`fully_shard`; median step time after warm-up, median over {c['rounds']} alternating launches each. "
              "Goal: <= 1.03 each.", "",
              "| step time ratio (MeshStrategy / ModelParallelStrategy) | peak memory ratio |", "|---|---|",
              f"| {d['step_time_ratio']:.2f} ({d['step_s']['mesh3d'] * 1e3:.0f} ms / {d['step_s']['lightning'] * 1e3:.0f} ms) | "
              f"{d['peak_memory_ratio']:.2f} |"]
    if (BENCH / "lightning.png").exists():
        lines += ["", "![lightning](benchmarks/lightning.png)"]
    lines.append("")


def _gpu(lines: list[str]) -> None:
    d = _load("gpu_check.json")
    if not d:
        return
    t = d["checkpoint_timing"]
    passed = sum(v.startswith("PASS") for v in d["checks"].values())
    lines += ["## On a GPU", "",
              f"`scripts/gpu_check.py` on {d['device']} (torch {d['torch']}, nccl, a world of one; another machine than "
              f"the figures above): {passed} of {len(d['checks'])} checks of the nccl/CUDA paths passed "
              f"({', '.join(d['checks'])}). Checkpoint of {t['state_bytes'] / 1e9:.2f} GB of FSDP state held on the GPU, "
              "best of 3, ratio = DCP's time / mesh3d's:", "",
              "| phase | mesh3d | torch.distributed.checkpoint | ratio |", "|---|---|---|---|",
              f"| save | {t['save_mesh3d']:.2f} s | {t['save_dcp']:.2f} s | {t['ratios']['save_mesh3d_vs_dcp']:.2f} |",
              f"| load | {t['load_mesh3d']:.2f} s | {t['load_dcp']:.2f} s | {t['ratios']['load_mesh3d_vs_dcp']:.2f} |", ""]
    rows, before = d.get("compile_d1"), d.get("compile_d1_before", {})
    if rows:
        commits, more = d.get("commits", {}), d.get("compile_d1_more_runs", [])
        lines += ["`torch.compile` (Inductor) at D=1 on the same GPU (`scripts/gpu_compile.py`): the compiled domain "
                  "step against compiled plain torch (goal <= 1.05), each a median of "
                  f"{d.get('compile_d1_repeats', 100)} alternated steps (input, forward, loss, backward). On torch older "
                  "than 2.13 the script runs compiled graphs with subclass dispatch off, as torch 2.13 does itself "
                  f"(`_torch_private.run_compiled_graphs_without_subclass_dispatch`). Rows at "
                  f"{commits.get('compile_d1', 'this commit')}; the ratio at "
                  f"{commits.get('compile_d1_before', 'the commit before')} in brackets"
                  + (f"; the same rows from {len(more)} more runs in the same session "
                     f"({', '.join(str(m['repeats']) for m in more)} steps each) under \"other runs\"" if more else "")
                  + ". Every step here is bound by host work (the 256x256 U-Net step takes about as long as the 64x64 "
                  "one), so each microsecond of Python or guard checking mesh3d adds shows.", "",
                  "| model | compiled plain | compiled domain | ratio | other runs | eager domain / eager plain | "
                  "`domain.shard` | graph breaks | recompiles | peak memory, domain / plain |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            was = before.get(name, {}).get("compiled_domain_vs_compiled_plain")
            others = ", ".join(f"{m['rows'][name]['compiled_domain_vs_compiled_plain']:.3f}" for m in more
                               if name in m["rows"]) or "-"
            lines.append(f"| {name} | {r['compiled_plain_ms']:.2f} ms | {r['compiled_domain_ms']:.2f} ms | "
                         f"{r['compiled_domain_vs_compiled_plain']:.3f}{f' ({was:.3f})' if was else ''} | {others} | "
                         f"{r['eager_domain_vs_eager_plain']:.2f} | {r['shard_us']:.0f} us | {r['graph_breaks']} | "
                         f"{r['recompiles']} | {r['compiled_peak_domain_vs_plain']:.3f} |")
        lines.append("")
        runs = [h for h in [d.get("compile_d1_host_overhead")] + [m.get("host_overhead") for m in more] if h]
        if runs:
            lines += ["Where the small stack's extra time goes (`gpu_compile.host_overhead`: a 2x1x8x8 conv stack, "
                      "where host work is all a step is; forward, backward and the input's `domain.shard` timed apart, "
                      "medians), one row per run:", "",
                      "| forward, plain | forward, domain extra | backward, plain | backward, domain extra | "
                      "`domain.shard` in the step |", "|---|---|---|---|---|"]
            lines += [f"| {h['fwd_plain_us']:.0f} us | {h['fwd_extra_us']:+.1f} us | {h['bwd_plain_us']:.0f} us | "
                      f"{h['bwd_extra_us']:+.1f} us | {h['shard_us']:.1f} us |" for h in runs]
            lines.append("")


def _plan(lines: list[str]) -> None:
    d = _load("plan.json")
    if not d:
        return
    lines += ["## Planning a 4096-rank job (`mesh3d plan`)", "",
              f"`scripts/bench_plan.py` on {d['machine']}, one process, no process group (torch {d['torch']}), median "
              "of the repeats. The alternative keys no classes: it simulates every domain rank (the model and batch "
              "axes need no simulation of their own either way); its time is the plan's with the classes' simulations "
              "replaced by every domain rank's, measured in the same run. A causal ring in the zigzag layout gives every "
              "domain rank its own queries, so the decoder's 16 domain ranks are 16 classes and keying them saves "
              "nothing there; its ring attention is modeled per pass, not run block by block. Goal: under 10 s for "
              "4096 ranks. Wall time "
              "moves with the machine's other load (load average "
              f"{d.get('load_average_before', float('nan')):.0f} before, {d.get('load_average_after', float('nan')):.0f} "
              "after, on 2 cores); CPU time is this process's own.", "",
              "| job (4096 ranks) | classes | ranks simulated | wall | CPU | every domain rank simulated | ratio |",
              "|---|---|---|---|---|---|---|"]
    for name, j in d["jobs"].items():
        without = j["wall_s"] - j["classes_s"] + j["every_domain_rank_s"]
        lines.append(f"| {name} | {j['classes']} | {j['simulated']} of {j['domain_ranks']} | {j['wall_s']:.1f} s | "
                     f"{j['cpu_s']:.1f} s | {without:.1f} s | {j['wall_s'] / without:.2f} |")
    lines += ["", "Scaling: bytes per rank times the shard degree, over the degree-1 figure (1.000: falls exactly as "
              "1/degree). FSDP pads dim 0 of every parameter to a multiple of its degree (at 512: the SwiGLU weights, "
              "1792 rows per model rank, and the 128256-row vocabulary); a rank's step peak on blocks also holds "
              "halo-extended copies of conv inputs for backward.", "",
              "| sweep | degree | params | grads | optimizer | input | step peak |", "|---|---|---|---|---|---|---|"]
    shown = {"fsdp_scaling": ("params", "grads", "optimizer"), "domain_scaling": ("input", "step_peak")}
    for key, label in (("fsdp_scaling", "FSDP degree (llama-8B, model 8)"), ("domain_scaling", "domain ranks (3-D U-Net, 256^3)")):
        for r in d[key]:
            x = r["ratio_x_degree"]
            lines.append(f"| {label} | {r['degree']} | " + " | ".join(
                f"{x[k]:.3f}" if k in shown[key] and x[k] is not None else "-"
                for k in ("params", "grads", "optimizer", "input", "step_peak")) + " |")
    if (BENCH / "plan.png").exists():
        lines += ["", "![plan](benchmarks/plan.png)"]
    lines.append("")


def faults_table(rows: list[dict]) -> list[str]:
    """The markdown table of ``scripts/bench_faults.py``'s cells (it prints the same)."""
    lines = ["| cell | runs | survivors naming the fault within the bound | hangs | what they raised | p50 s | max s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r["errors"].items()))
        p50 = "" if r["p50_s"] is None else f"{r['p50_s']:.2f}"
        top = "" if r["max_s"] is None else f"{r['max_s']:.2f}"
        lines.append(f"| {r['cell']} | {r['runs']} | {r['named']}/{r['survivors']} | {r['hangs']} | {kinds} | {p50} | {top} |")
    return lines


def _faults(lines: list[str]) -> None:
    d = _load("faults.json")
    if d is None:
        return
    w, rows = d["settings"]["watch"], d["cells"]
    named, total, hangs = (sum(r[k] for r in rows) for k in ("named", "survivors", "hangs"))
    lines += ["## Faults: time to a named error", "",
              f"`scripts/bench_faults.py`: the {len(rows)} cells of `tests/faults/` ({d['settings']['ranks']} gloo ranks, "
              "batch 1 x domain 3 with a conv stack under FSDP over batch x domain, or for the tp cell model 3 with a "
              "colwise/rowwise MLP, inside `dm.guard`; the data cell iterates a `MeshDataLoader`, then agrees to stop; rank "
              f"{d['settings']['victim']} is killed (SIGKILL), raises, or hangs at each point), {d.get('cpu', 'this CPU')}. "
              f"Watch settings: heartbeat every {w['interval']} s, `suspect_after` {w['suspect_after']} s, `dead_after` "
              f"{w['dead_after']} s, `grace` {w['grace']} s; group timeout {d['settings']['group_timeout_s']} s. Seconds run "
              "from the victim's fault (its timestamp in the store) to each survivor's error; for an `exit` (a survivor "
              "blocked inside a gloo collective, ended by the watch with status 76 after printing the named "
              "`PeerLostError`), from the start of the run. A hang is a run the pool's timeout had to end.", "",
              *faults_table(rows), "",
              f"{named} of {total} survivor outcomes named the victim by rank and mesh coordinates; {hangs} hangs. A kill "
              "is named at once in a domain exchange (the neighbour sees the connection close) and after "
              "`suspect_after` plus a beat elsewhere; a hang when the group timeout fires; an exception leaving one "
              "rank's `dm.guard` while its process stays alive within a beat, but peers blocked inside a gloo "
              "collective can only be ended, after `grace` (troubleshooting.md, section 8).", ""]
    div = d.get("divergence") or {}
    if div.get("runs"):
        lines += [f"Ranks that diverge (three ranks split (5, 4, 4), a model that pads only where its *local* height is "
                  f"odd, diverging in forward and in backward alternately): every rank raised `DomainDivergenceError` "
                  f"in **{div['named_on_every_rank']} of {div['runs']}** runs.", ""]


def main() -> None:
    lines = ["# Benchmarks", "",
             "Generated by `scripts/bench_report.py` from `docs/benchmarks/*.json`; `scripts/bench_all.sh` reruns "
             "everything (JSON + PNG) and this page. Each figure is a ratio against the best alternative measured in "
             "the same run.", "",
             f"Machine this page was generated on: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} "
             f"{platform.release()}, Python {platform.python_version()}; CPU only, gloo. A section was measured when "
             "its JSON was written; sections whose JSON records the CPU name it. Ranks share the cores "
             "(8 ranks on 2 cores are 4x oversubscribed), so absolute times are noisy: a few percent between runs for "
             "step times, up to +-30 % for disk-bound checkpoint phases.", ""]
    _parallelize(lines)
    _domain(lines)
    _compile(lines)
    _blocks(lines)
    _attention(lines)
    _checkpoint(lines)
    _pretrained(lines)
    _checkpoint_async(lines)
    _faults(lines)
    _lightning(lines)
    _plan(lines)
    _gpu(lines)
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(lines))
    print(f"wrote {ROOT / 'docs' / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
