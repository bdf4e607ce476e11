"""Which launcher started this process, read from the environment alone.

Nothing here talks to other processes: detection must be safe to run before
any collective, so that bad input can be refused on every rank without a hang.

Usage::

    info = detect_launcher()          # LaunchInfo(launcher="torchrun", rank=3, world_size=8, ...)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["LaunchInfo", "detect_launcher", "first_slurm_host", "refuse_if_launched_uninitialized", "slurm_master_port"]

# SLURM gives every rank the same job id, so a port derived from it agrees across
# ranks without any communication. NOTE: the range 15000-32767 stays below Linux's ephemeral
# ports (32768-60999 by default), which the kernel hands to outgoing connections: a master
# port in that range can be taken by a connection before rank 0 binds it.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 17768


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher described it.

    Usage: ``info = detect_launcher(); info.launcher, info.rank, info.world_size``

    ``launcher`` is ``"torchrun"`` (torch elastic), ``"env"`` (the same variables set
    by something else), ``"slurm"`` (``srun`` without torchrun) or ``"none"`` (a plain
    ``python`` process: a world of one).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is required by this launcher but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _check_rank(launcher: str, rank: int, world_size: int, local_rank: int) -> None:
    if world_size < 1:
        raise ValueError(f"{launcher}: world size {world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"{launcher}: rank {rank} is outside [0, {world_size}) for world size {world_size}")
    if local_rank < 0:
        raise ValueError(f"{launcher}: local rank {local_rank} must not be negative")


def _split_top_level(nodelist: str) -> list[str]:
    """Split a SLURM hostlist on the commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in (s.strip() for s in parts) if p]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a compressed SLURM hostlist.

    ``first_slurm_host("gpu[007-010,12],login1")`` → ``"gpu007"``; zero padding is
    kept and every bracket group takes its first value (``rack[1-2]-n[03-04]`` →
    ``rack1-n03``), which is how ``scontrol show hostnames`` orders them.
    """
    entries = _split_top_level(nodelist)
    if not entries:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    host = entries[0]
    while (match := re.search(r"\[([^\]]*)\]", host)) is not None:
        first_range = match.group(1).split(",")[0]
        first_value = first_range.split("-")[0]
        if not first_value:
            raise ValueError(f"SLURM node list {nodelist!r} has an empty range in {match.group(0)!r}")
        host = host[: match.start()] + first_value + host[match.end() :]
    return host


def slurm_master_port(job_id: str | None) -> int:
    """A port that every rank of one SLURM job derives identically from its job id."""
    if job_id is None or not job_id.strip().isdigit():
        return _SLURM_PORT_BASE
    return _SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world size and rendezvous address from the launcher's variables.

    Usage: ``info = detect_launcher()  # or detect_launcher(os.environ)``

    torchrun's variables win over SLURM's, because ``srun torchrun ...`` sets both
    and the ranks torchrun assigns are the ones its workers must use.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        local_rank = _int_var(env, "LOCAL_RANK", default=rank)
        _check_rank(launcher, rank, world_size, local_rank)
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if world_size > 1 and (addr is None or port is None):
            raise ValueError(
                f"{launcher}: RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
                "set both (torchrun does this for you) or unset RANK/WORLD_SIZE for a single process"
            )
        return LaunchInfo(launcher, rank, world_size, local_rank, addr, _int_var(env, "MASTER_PORT", 0) or None)

    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world_size = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        local_rank = _int_var(env, "SLURM_LOCALID", default=0)
        _check_rank("slurm", rank, world_size, local_rank)
        addr = env.get("MASTER_ADDR")
        if addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if nodelist is None:
                if world_size > 1:
                    raise ValueError(
                        "slurm: no SLURM_JOB_NODELIST to find the first node; set MASTER_ADDR to the address of rank 0"
                    )
                nodelist = "localhost"
            addr = first_slurm_host(nodelist)
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else slurm_master_port(env.get("SLURM_JOB_ID"))
        return LaunchInfo("slurm", rank, world_size, local_rank, addr, port)

    return LaunchInfo("none", 0, 1, 0, None, None)


def refuse_if_launched_uninitialized(what: str) -> None:
    """Raise if a launcher started several ranks but nothing initialized mesh3d or torch.distributed.

    Without a process group every rank would act as a world of one (each keeping the whole
    tensor, or all writing the same checkpoint files); in a plain ``python`` process being
    alone is right, so that case passes.
    """
    if dist.is_available() and dist.is_initialized():
        return
    launched = detect_launcher()
    if launched.world_size > 1:
        raise RuntimeError(
            f"{what}: this is rank {launched.rank} of {launched.world_size} ({launched.launcher}), but "
            "DistributedManager.initialize(batch=..., domain=..., model=...) has not been called; call it "
            "first, on every rank"
        )
