"""The "Graphs and meshes" section of docs/benchmarks.md (``bench_report.py`` calls it), from graph_partition.json and
graph_memory.json.

Usage: ``graph_sections(lines)``
"""

from __future__ import annotations

from bench_common import BENCH, load_bench_json


def graph_sections(lines: list[str]) -> None:
    part, mem = load_bench_json("graph_partition.json"), load_bench_json("graph_memory.json")
    if not part and not mem:
        return
    lines += ["## Graphs and meshes", ""]
    if mem:
        lines += [f"`scripts/bench_graph_memory.py`: one MeshGraphNet step (forward and backward; {mem['blocks']} "
                  f"message-passing blocks of {mem['hidden']} features, fp32) on a {mem['nodes']}-node, "
                  f"{mem['edges']}-edge triangulated channel, in one process and on {mem['world']} domain ranks "
                  "(nodes along a Hilbert curve), each a fresh process; the step's peak RSS above what the process held "
                  f"before it. Goal: the largest rank <= 0.35x one process. Machine: {mem['cpu']}, torch {mem['torch']}.",
                  "", "| | step peak |", "|---|---|", f"| one process | {mem['one_process_step_peak_mb']:.0f} MB |",
                  *(f"| rank {r} of {mem['world']} | {v:.0f} MB |" for r, v in enumerate(mem["per_rank_step_peak_mb"])),
                  "", f"Largest rank / one process: **{mem['ratio_max_rank']:.3f}** (an even split of the one-process peak "
                  f"would be 1/{mem['world']} = {1 / mem['world']:.3f}; each rank adds its halo rows and partition tables)."]
        if (BENCH / "graph_memory.png").exists():
            lines += ["", "![graph_memory](benchmarks/graph_memory.png)"]
        lines.append("")
    if part:
        lines += [f"`scripts/bench_graph_partition.py`: partitioning a {part['nodes']}-node, {part['edges']}-edge mesh "
                  f"into {part['parts']} parts on one core (one thread). CPU seconds are the measure (wall seconds "
                  "also count what else the shared machine ran); the halo is the rows all ranks receive per gather of "
                  f"the sources, as a share of the nodes. Goal: under 60 s. Machine: {part['cpu']}, torch "
                  f"{part['torch']}.", "", "| partitioner | CPU s | wall s | halo rows per rank | halo / nodes |",
                  "|---|---|---|---|---|"]
        for name, row in part["methods"].items():
            cpu = row.get("cpu_seconds")
            lines.append(f"| {name} | {'' if cpu is None else f'{cpu:.1f}'} | {row['seconds']:.1f} | "
                         f"{', '.join(map(str, row['halo_rows']))} | {100 * row['halo_fraction']:.2f} % |")
        lines += ["", "metis is METIS's k-way partitioner through pymetis; bfs the fallback without it (a breadth-first "
                  "order cut into even runs); hilbert and morton order the node coordinates along the curve.", ""]
