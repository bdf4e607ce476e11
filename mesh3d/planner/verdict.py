"""Will it fit: the planned peak of the worst class of ranks, plus a stated margin for what the plan does not model.

The plan models every tensor of the step and the kernels' transient buffers; a device also holds what no
tensor accounts for. The margin adds, per rank:

* on CUDA, 1 GiB for the CUDA context and the libraries' persistent state (cuBLAS/cuBLASLt workspaces of
  32 MiB per stream on Hopper, cuDNN's handle, the kernels loaded): memory the caching allocator does not
  count or counts only once;
* on CUDA, 512 MiB of NCCL buffers for each process group the step communicates on: every axis with
  collectives, and the domain axis when it exchanges halos or attention blocks. NCCL's buffers depend on
  its channels and protocols (``NCCL_BUFFSIZE``, NVLS); this is a round figure for the defaults on NVLink
  machines, not a measurement (point-to-point pairs may add smaller communicators of their own);
* 10 % of the planned peak for the allocator's fragmentation (cached blocks a new request cannot use).

A fixed ``margin=`` in bytes replaces the whole estimate.

Usage::

    verdict = judge(classes, device="cuda", device_memory=80 * 2**30, communicators=communicators_used(classes))
    verdict["status"], verdict["line"]      # "fits" / "tight" / "does not fit" / "unknown", one line for people
"""

from __future__ import annotations

from typing import Any

from mesh3d.planner.report import RankClass, human_bytes

__all__ = ["CONTEXT_BYTES", "FRAGMENTATION", "NCCL_BYTES", "communicators_used", "judge", "margin_of"]

CONTEXT_BYTES = 1 << 30
NCCL_BYTES = 512 << 20
FRAGMENTATION = 0.10


def communicators_used(classes: list[RankClass]) -> int:
    """Process groups the step communicates on: one per axis with collectives, one for the domain's exchanges.

    Usage: ``communicators_used(job.classes)``
    """
    axes = {row["axis"] for c in classes for row in c.comm}
    if any(c.domain["messages"]["forward"] or c.domain["messages"]["backward"] for c in classes):
        axes.add("domain")
    return len(axes)


def margin_of(peak: int, device: str, communicators: int, fixed: int | None = None) -> dict[str, int]:
    """The margin's parts for a rank whose planned peak is ``peak`` (bytes), and their ``total``.

    Usage: ``margin_of(40 * 2**30, "cuda", 3)["total"]``
    """
    if fixed is not None:
        return {"fixed": fixed, "total": fixed}
    parts = {"cuda context and libraries": CONTEXT_BYTES if device == "cuda" else 0,
             "nccl buffers": NCCL_BYTES * communicators if device == "cuda" else 0,
             "allocator fragmentation": int(FRAGMENTATION * peak)}
    return {**parts, "total": sum(parts.values())}


def _describe(margin: dict[str, int], communicators: int) -> str:
    if "fixed" in margin:
        return f"{human_bytes(margin['total'])}, as given (--margin)"
    parts = []
    if margin["cuda context and libraries"]:
        parts.append(f"CUDA context and libraries {human_bytes(margin['cuda context and libraries'])}")
    if margin["nccl buffers"]:
        parts.append(f"NCCL buffers {communicators} x {human_bytes(NCCL_BYTES)}")
    parts.append(f"allocator fragmentation {FRAGMENTATION:.0%} of the peak ({human_bytes(margin['allocator fragmentation'])})")
    return f"{human_bytes(margin['total'])} = " + " + ".join(parts)


def judge(classes: list[RankClass], *, device: str, device_memory: int | None, communicators: int,
          margin: int | None = None) -> dict[str, Any]:
    """The verdict on the worst class (the largest peak plus margin): a dict with ``status`` ("fits", "tight": only
    without the margin, "does not fit", "unknown": no device memory given), ``worst_class``, ``peak``,
    ``margin`` (its parts), ``needed`` (peak + margin), ``device_memory``, ``over`` (classes needing more),
    ``line`` (the report's first line) and ``margin_line`` (what the margin is made of).

    Usage: ``judge(job.classes, device="cuda", device_memory=80 * 2**30, communicators=2)["line"]``
    """
    needs = [c.memory["peak"] + margin_of(c.memory["peak"], device, communicators, margin)["total"] for c in classes]
    worst = max(range(len(classes)), key=needs.__getitem__)
    peak = classes[worst].memory["peak"]
    parts = margin_of(peak, device, communicators, margin)
    over = [i for i, n in enumerate(needs) if device_memory is not None and n > device_memory]
    if device_memory is None:
        status = "unknown"
    elif not over:
        status = "fits"
    else:
        status = "tight" if peak <= device_memory else "does not fit"
    c = classes[worst]
    who = f"class {worst} ({c.count} rank{'s' if c.count != 1 else ''}, e.g. rank {c.examples[0]})"
    need = f"peaks at {human_bytes(peak)} + margin {human_bytes(parts['total'])} = {human_bytes(needs[worst])}"
    if device_memory is None:
        line = f"verdict: no --device-memory given; the worst, {who}, {need}"
    else:
        verb = {"fits": "FITS", "tight": "TIGHT (fits only without the margin)", "does not fit": "DOES NOT FIT"}[status]
        share = f"{needs[worst] / device_memory:.0%} of {human_bytes(device_memory)}"
        counted = f"; {len(over)} of {len(classes)} classes ({sum(classes[i].count for i in over)} ranks) need more" \
            if over else ""
        line = f"verdict: {verb} in {human_bytes(device_memory)}: the worst, {who}, {need} ({share}){counted}"
    return {"status": status, "worst_class": worst, "peak": peak, "margin": parts, "needed": needs[worst],
            "device_memory": device_memory, "over": over, "line": line,
            "margin_line": f"margin for what is not modeled, per rank: {_describe(parts, communicators)}"}
