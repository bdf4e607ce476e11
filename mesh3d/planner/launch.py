"""Local gloo ranks for ``mesh3d check``: started once, then every mesh runs on as many of them as it needs.

Starting processes that import torch takes seconds each on a small machine, so ``LocalRanks`` starts the
largest world once, forked from a server process that imported torch and mesh3d once (``forkserver``: one import
for all ranks, not one per rank; no threads of the caller are forked). For each job the first ``world`` ranks make a
fresh default process group (a ``FileStore`` of its own), run the function, destroy the group and send back its
result; the other ranks wait. A job that does not finish in time kills every rank and raises.

Usage::

    with LocalRanks(4) as ranks:
        results = ranks.run(2, check_on_rank, spec, mesh, sizes)     # one result per rank, by rank
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from mesh3d import forkserver

__all__ = ["LocalRanks"]


def _rank_main(rank: int, conn: Any) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(var, None)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        _, world, store_path, fn, args = message
        if rank >= world:
            conn.send(("idle", None))
            continue
        try:
            store = dist.FileStore(store_path, world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=5))
            try:
                conn.send(("ok", fn(*args)))
            finally:
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))


class LocalRanks:
    """``size`` processes that run functions on gloo groups of any size up to ``size`` (see module doc)."""

    def __init__(self, size: int, timeout_s: float = 600.0) -> None:
        # NOTE: 4 ranks each importing torch and mesh3d (about 6 s of CPU each on a 2-core AVX2 machine) were most of
        # a `mesh3d check` of a tiny model; mesh3d/forkserver.py imports them once.
        forkserver.start()
        ctx = multiprocessing.get_context("forkserver")
        self.size, self.timeout_s = size, timeout_s
        self._dir = tempfile.mkdtemp(prefix="mesh3d-check-")
        self._jobs = 0
        self._conns, self._procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, child), daemon=True, name=f"mesh3d-check-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` on ranks ``0 .. world-1`` in one gloo group; their results by rank."""
        if not 1 <= world <= self.size:
            raise ValueError(f"a job of {world} ranks does not fit {self.size} local ranks")
        self._jobs += 1
        store = os.path.join(self._dir, f"store-{self._jobs}")
        for conn in self._conns:
            conn.send(("run", world, store, fn, args))
        replies: dict[int, tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            ready = wait(list(pending), timeout=self.timeout_s)
            if not ready:
                self.close()
                raise TimeoutError(f"local ranks {sorted(pending.values())} did not finish a job of {world} ranks in "
                                   f"{self.timeout_s:.0f} s; they were stopped")
            for conn in ready:
                try:
                    replies[pending.pop(conn)] = conn.recv()
                except EOFError:
                    self.close()
                    raise RuntimeError("a local rank died while running a job (see its output above)") from None
        failures = [f"--- rank {r} ---\n{v}" for r, (status, v) in sorted(replies.items()) if status == "error"]
        if failures:
            raise RuntimeError("a job failed on local ranks:\n" + "\n".join(failures))
        return [replies[r][1] for r in range(world)]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
