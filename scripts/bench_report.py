#!/usr/bin/env python
"""Write docs/benchmarks.md from the JSON files the benchmark scripts left in docs/benchmarks/.

Usage::

    python scripts/bench_report.py          # scripts/bench_all.sh runs it last

Every figure is a ratio against the alternative measured in the same run, so the page states
the machine the files came from but compares nothing across machines. Blocks of the page written by hand (between
``<!-- by hand -->`` and ``<!-- /by hand -->``) are kept (``bench_report_kept.py``).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import BENCH, cpu_model, load_bench_json as _load  # noqa: E402
from bench_report_domain import domain_sections  # noqa: E402
from bench_report_graphs import graph_sections  # noqa: E402
from bench_report_kept import keep_hand_written  # noqa: E402
from bench_report_forecast import forecast_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


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
              "of the repeats. Two alternatives, measured in the same run. Every block simulated: a deep stack of "
              "identical blocks is planned from 4 of them, spliced to all (`mesh3d.planner.repeat`); the alternative "
              "simulates all 32 of the decoder's layers (`splice_blocks=False`, the planner before), and the script "
              "stops if any figure differs. Every domain rank simulated: the plan with the classes' simulations "
              "replaced by every domain rank's (the model and batch axes need no simulation of their own either way). "
              "A causal ring in the zigzag layout gives every domain rank its own queries, so the decoder's 16 domain "
              "ranks are 16 classes and keying them saves nothing there; its ring attention is modeled per pass, not "
              "run block by block. Goals: under 10 s for 4096 ranks; the documented `mesh3d plan` command for the "
              "decoder, imports included, in at most 5 s. Wall time "
              "moves with the machine's other load (load average "
              f"{d.get('load_average_before', float('nan')):.0f} before, {d.get('load_average_after', float('nan')):.0f} "
              "after, on 2 cores); CPU time is this process's own.", "",
              "| job (4096 ranks) | classes | ranks simulated | blocks simulated | wall | CPU | every block simulated "
              "| ratio | every domain rank simulated | ratio |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, j in d["jobs"].items():
        without = j["wall_s"] - j["classes_s"] + j["every_domain_rank_s"]
        whole = j.get("every_block_s")
        blocks = j["spliced"].split(" each")[0] if j.get("spliced") else "all"
        lines.append(f"| {name} | {j['classes']} | {j['simulated']} of {j['domain_ranks']} | {blocks} | "
                     f"{j['wall_s']:.1f} s | {j['cpu_s']:.1f} s | "
                     + (f"{whole:.1f} s | {j['wall_s'] / whole:.2f} | " if whole else "- | - | ")
                     + f"{without:.1f} s | {j['wall_s'] / without:.2f} |")
    if "command_s" in d:
        lines += ["", f"The documented command (`mesh3d plan examples/llama_decoder.py:llama_8b --world 4096 ...`, "
                  f"docs/plan.md) through the console script, imports included: {d['command_s']:.1f} s"
                  + (f", with its domain classes simulated in {d['command_workers']} processes; with `--workers 1` "
                     f"(one process): {d['command_one_worker_s']:.1f} s, ratio {d['command_s'] / d['command_one_worker_s']:.2f}."
                     if "command_one_worker_s" in d else ".")]
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


def page_lines() -> list[str]:
    """The page's lines from the JSON files, without the blocks written by hand.

    Usage: ``lines = page_lines()``
    """
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
    domain_sections(lines)
    graph_sections(lines)
    _checkpoint(lines)
    _pretrained(lines)
    _checkpoint_async(lines)
    forecast_section(lines)
    _faults(lines)
    _lightning(lines)
    _plan(lines)
    _gpu(lines)
    return lines


def main() -> None:
    page = ROOT / "docs" / "benchmarks.md"
    lines = keep_hand_written(page.read_text() if page.exists() else "", page_lines())
    page.write_text("\n".join(lines))
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
