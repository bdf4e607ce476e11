"""The forecast section of docs/benchmarks.md, from docs/benchmarks/forecast.json and forecast_raw.json.

Usage (bench_report.py calls it)::

    from bench_report_forecast import forecast_section
    forecast_section(lines)
"""

from __future__ import annotations

from bench_common import load_bench_json


def _gib(kb: float) -> str:
    return f"{kb / 2 ** 20:.2f} GiB"


def _write_row(name: str, d: dict) -> str:
    return (f"| store write ({name}), MB/s | {d['store_one_mb_s']:.0f} (np.save: {d['np_save_one_mb_s']:.0f}) | "
            f"{len(d['ranks'])} ranks together: {d['store_ranks_mb_s']:.0f} (np.save: {d['np_save_ranks_mb_s']:.0f}) | "
            f"{d['store_one_vs_np_save']:.2f}, {d['store_ranks_vs_np_save']:.2f} of np.save |")


def _memory_rows(d: dict) -> list[str]:
    one, worst = d["one_process"], max(d["ranks"], key=lambda r: r["peak_kb"])
    adaptive = max(d["ranks_glibc_default"], key=lambda r: r["peak_kb"]) if "ranks_glibc_default" in d else None
    leads = f"{d['leads']} leads"
    rows = [f"| {leads}: peak RSS | {_gib(one['peak_kb'])} | {_gib(worst['peak_kb'])} | **{d['peak_ratio']:.2f}** |",
            f"| {leads}: peak above the process after imports ({_gib(one['baseline_kb'])}) | "
            f"{_gib(one['peak_kb'] - one['baseline_kb'])} | {_gib(worst['peak_kb'] - worst['baseline_kb'])} | "
            f"**{d['peak_above_baseline_ratio']:.2f}** |"]
    if adaptive is not None:
        rows.append(f"| {leads}, glibc's adaptive mmap threshold (`release_memory=False`): peak above imports | | "
                    f"{_gib(adaptive['peak_kb'] - adaptive['baseline_kb'])} | "
                    f"{d['glibc_default_peak_above_baseline_ratio']:.2f} |")
    if d["leads"] > 2 and "rank_growth_last_over_lead2" in d:
        rows.append(f"| {leads}: peak in lead {d['leads']} over lead 2 | {d['one_growth_last_over_lead2']:.3f} | "
                    f"{d['rank_growth_last_over_lead2']:.3f} (adaptive: {d['glibc_default_growth_last_over_lead2']:.3f}) | |")
    if "seconds_over_glibc_default" in d:
        n = len(d["ranks_seconds"])
        rows.append(f"| {leads}: seconds, slowest rank (median of {n}, alternating) | {one['seconds']:.1f} | "
                    f"{sorted(d['ranks_seconds'])[n // 2]:.1f} (adaptive: {sorted(d['glibc_default_seconds'])[n // 2]:.1f}) | "
                    f"{d['seconds_over_glibc_default']:.2f} of adaptive |")
    return rows


def forecast_section(lines: list[str]) -> None:
    d = load_bench_json("forecast.json")
    if d is None:
        return
    raw, long = load_bench_json("forecast_raw.json"), load_bench_json("forecast_60.json")
    loads = ", ".join(f"{x['load_average']:.1f}" for x in (d, long, raw) if x)
    lines += [
        "## Forecasts: memory per rank and write throughput", "",
        f"`scripts/bench_forecast.py`: one forecast of a {d['field']} field (a residual pair of 3x3 sphere convolutions "
        "70 -> 16 -> 70; one init, one member, no restart state; `forecast_ensemble` reading its initial state from a "
        "zarr store and writing the CF store) in a fresh process alone, on D = "
        f"{d['domain']} ranks under torchrun (latitude slabs aligned to the store's tiles), and on D ranks again with "
        "`release_memory=False` (glibc's adaptive mmap threshold, what forecasts did before). Peak memory is each "
        "process's peak RSS (VmHWM, reset after the imports and the model, and after every lead for the per-lead "
        "trace); write throughput is the bytes a process wrote to the store over the seconds its writes took (the "
        "conversion to physical units included), against `np.save` of the same bytes (one new file per lead) timed in "
        "the same process right after, on the same disk, neither fsynced. The two D-rank variants run alternately "
        f"(`--repeat`). Machine: {d['machine']} (load average {loads} at the ends of the runs). Goal: a rank's peak "
        f"above its imports at D = {d['domain']} <= 0.30 x one process's, flat over the leads.", "",
        f"| | one process | worst of {len(d['ranks'])} ranks | ratio |", "|---|---|---|---|",
        *_memory_rows(d), *(_memory_rows(long) if long else []),
        _write_row("zstd, zarr's default", d)]
    if raw:
        lines.append(_write_row("`--raw`: no compression", raw))
    lines += [
        "",
        "Memory: a rank's peak above its imports is 0.27 of one process's, at 10 leads and at 60 alike, and flat over "
        "the leads. Before, a rank's peak grew by 34 MiB at its second lead (then stayed), and the ratio was 0.31 to 0.32: "
        "glibc raises its mmap threshold to the size of the first large array freed (up to 32 MiB), so a rank's "
        "17 MB activations then came from malloc's heap and stayed resident; no Python object grew (tracemalloc). "
        "One process's 66 MB activations are above glibc's ceiling and were always returned. `forecast_ensemble` "
        "now fixes the threshold at 1 MiB (`mesh3d.host_memory.return_freed_memory`, `release_memory=True`); the "
        "time row shows what that costs (the freed pages come back zeroed from the OS at every lead): nothing "
        "measurable. The whole peak is nearly half of one process's because every process carries its imports "
        "(torch, mesh3d, xarray, zarr), which a domain split cannot divide; above them a rank holds 0.27 of one "
        "process, near the quarter a split in four gives (the rest, a rank's halo rows and its reads of whole "
        "store chunks among it, is not traced further). On a GPU the imports stay on the host, so the device-memory "
        "ratio would be the second row's. The store writes at a tenth to a fifth of `np.save`'s rate, compressed "
        "or not: zarr copies each chunk (all channels of a tile, a strided gather from the block) and writes one "
        "file per tile where `np.save` writes one contiguous file, and the writes here include the conversion to "
        "physical units. The script takes any field (`--lat 361 --lon 720`, `--channels`, `--domain`, `--leads`); "
        "the dataset (2 times, 0.6 GB) is written once.", "",
        "![forecast memory and write throughput](benchmarks/forecast.png)", ""]
