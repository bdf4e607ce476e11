"""A pool of long-lived gloo ranks that runs test bodies on every rank.

Starting 8 processes that import torch costs ~20 s on two cores. Instead, ranks are
forked from a forkserver that imported torch once (~1 s for 8 ranks), join one gloo
group, and then run many test bodies each. A body that fails reports every failing
rank's traceback; a body that hangs is stopped after its timeout, the stacks of the
ranks that did not answer are shown, and the pool is rebuilt for the next test.

Usage::

    pool = RankPool(4)
    results = pool.run(body, 2, x=3)     # body(2, x=3) on every rank; results[r] from rank r
    pool.close()
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from rankpool.worker import DUMP_SIGNAL, worker_main

__all__ = ["RankPool", "RankFailure", "RankTimeout", "DEFAULT_TIMEOUT_S", "forkserver_context"]

#: Default seconds a body may take on all ranks before it counts as hung.
DEFAULT_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 120.0
_STACK_DUMP_WAIT_S = 1.0
_LOG_TAIL_CHARS = 6000
#: A rank holding more live gloo groups than this (worker.gloo_loop_threads) is recycled after its body.
_MAX_GLOO_THREADS = 32

_context: Any = None


def forkserver_context() -> Any:
    """One forkserver for the session, with torch (and mesh3d) imported before any fork.

    Its children are forks of that single-threaded server, never of the (threaded) pytest process.
    """
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # NOTE: torch._dynamo is what a process's first optimizer step imports (~1.5 s): preloaded once here,
        # not again in every rank (pools restart after each failing body) and every checkpoint crash child.
        # mesh3d.manager and mesh3d.parallel (the domain layers under it): what `import mesh3d` loaded before it was lazy.
        # The libraries many test bodies import (Lightning 3.5 s alone on the 2-core machine, MONAI's networks 5 s,
        # Inductor 1.6 s, zarr and xarray 0.6 s): a pool restarts after every failing body and every few dozen meshes,
        # and each of its new ranks imported them again. Only in a whole run (on pytest-xdist's workers): a run of a
        # few files would wait for them whether its bodies import them or not. The forkserver skips a name that raises
        # ImportError (one not installed): a body that needs it imports it itself and says what is wrong.
        # NOT torch_geometric: importing it replaces torch.select and torch.index_select for the whole process, and
        # mesh3d must be right without it too (test_domain_graph_pyg imports it in its own bodies).
        # NOTE: the server imports these before it takes the parent's sys.path (multiprocessing/forkserver.py, 3.11):
        # only what the interpreter finds by itself (site-packages, an installed mesh3d), not the tests' own modules.
        preload = ["torch", "torch.distributed", "torch._dynamo", "mesh3d.manager", "mesh3d.parallel"]
        if os.environ.get("PYTEST_XDIST_WORKER"):
            preload += ["lightning.pytorch", "monai.networks.nets", "torch._inductor.compile_fx", "zarr", "xarray"]
        _context.set_forkserver_preload(preload)
    return _context


class RankFailure(AssertionError):
    """One or more ranks raised or died; the message holds each failing rank's traceback (or log), and
    ``results`` what the other ranks returned ({rank: value}: a fault test reads the survivors' outcomes there)."""

    def __init__(self, message: str, results: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.results = results or {}


class RankTimeout(AssertionError):
    """Some ranks did not answer in time; the message holds their stacks."""


class RankPool:
    """``world_size`` ranks in one gloo group, kept alive across test bodies."""

    def __init__(self, world_size: int, pg_timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._logs: list[str] = []
        self._task_id = 0
        self._store: Any = None
        self._watchdog: subprocess.Popen | None = None
        self._log_dir = tempfile.mkdtemp(prefix=f"mesh3d-pool{world_size}-")
        self.starts = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = forkserver_context()
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        # Held for the pool's life: every new_group (each mesh a test builds) rendezvouses through it.
        self._store = store
        self.starts += 1
        self._logs = [os.path.join(self._log_dir, f"start{self.starts}-rank{r}.log") for r in range(self.world_size)]
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, store.port, child_end, self._logs[rank], self.pg_timeout_s, os.getpid()),
                name=f"mesh3d-rank{rank}of{self.world_size}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        self._watch_parent()
        deadline = time.monotonic() + _START_TIMEOUT_S
        replies = self._collect(deadline)
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing:
            detail = self._describe_unanswered(missing, "", offsets=[0] * self.world_size)
            self.close()
            raise RuntimeError(f"rank pool of {self.world_size} failed to start; ranks {missing} not ready\n{detail}")

    def _watch_parent(self) -> None:
        """A shell that SIGKILLs these ranks once this pytest process is gone (killed, or ended by CI's time limit).

        NOTE: a stopped rank (``suspend``) cannot watch for that itself, and its parent, the forkserver, lives as long
        as any rank holds its ``alive`` pipe (each does): without this a killed pytest left every idle rank behind.
        Stopped with the pool (``_end_watch``) before the ranks' pids can be reused."""
        pids = " ".join(str(p.pid) for p in self._procs)
        script = f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; kill -9 {pids} 2>/dev/null"
        self._watchdog = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)

    def _end_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None

    def _signal(self, sig: int) -> None:
        for proc in self._procs:
            if proc.pid is not None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def suspend(self) -> None:
        """Stop the ranks (SIGSTOP) between bodies: an idle rank's gloo threads wake about a hundred times a second
        per group, and with several pools alive (one per world size) idle ranks took a quarter of the two cores.

        NOTE: only between bodies, when every rank has answered and sits in ``conn.recv()``: no collective is in
        flight, and a stopped rank's peers are stopped too. ``run`` resumes them (SIGCONT) before the next body."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop every rank (politely if idle, by force otherwise)."""
        self.resume()
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._end_watch()
        self._procs, self._conns, self._store = [], [], None

    def remove_logs(self) -> None:
        """Delete the pool's log folder (a failing test already showed its part of the logs)."""
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._end_watch()
        self._procs, self._conns, self._store = [], [], None

    # ------------------------------------------------------------------ running bodies

    def _collect(self, deadline: float) -> dict[int, Any]:
        """Wait for one message per rank until ``deadline``; a dead rank is recorded as such."""
        replies: dict[int, Any] = {}
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = [c for c, r in by_conn.items() if r not in replies]
            waiting += [s for s, r in by_sentinel.items() if r not in replies]
            for ready in wait(waiting, timeout=remaining):
                if ready in by_conn:
                    rank = by_conn[ready]
                    try:
                        replies[rank] = ready.recv()
                    except (EOFError, OSError):
                        self._procs[rank].join(timeout=5)  # the pipe closes just before the exit code is known
                        replies[rank] = ("died", None, self._procs[rank].exitcode)
                else:
                    rank = by_sentinel[ready]
                    if rank not in replies and not self._conns[rank].poll():
                        self._procs[rank].join(timeout=1)
                        replies[rank] = ("died", None, self._procs[rank].exitcode)
        return replies

    def _log_since(self, rank: int, offset: int) -> str:
        try:
            with open(self._logs[rank], errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return ""
        return text[-_LOG_TAIL_CHARS:]

    def _describe_unanswered(self, ranks: list[int], name: str, offsets: list[int]) -> str:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, DUMP_SIGNAL)
        time.sleep(_STACK_DUMP_WAIT_S)
        parts = [f"--- rank {rank} (output and stacks since {name or 'start'}) ---\n{self._log_since(rank, offsets[rank])}"
                 for rank in ranks]
        return "\n".join(parts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, fresh: bool = False,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return each rank's result, by rank.

        ``fn`` must be importable (a module-level function). Raises :class:`RankFailure`
        with every failing rank's traceback, or :class:`RankTimeout` with the stacks of
        the ranks that had not answered after ``timeout`` seconds; after either, the
        ranks are restarted so the next body starts from a clean group. ``fresh``: new processes
        for this body (what it measures must not depend on what earlier bodies left, e.g. malloc's heap).
        """
        self.resume()
        try:
            return self._run(fn, args, kwargs, timeout, fresh)
        finally:
            self.suspend()

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, fresh: bool) -> list[Any]:
        if fresh and self.alive:
            self.close()
        if not self.alive:
            self._kill()
            self._start()
        payload = pickle.dumps((fn, args, kwargs))
        self._task_id += 1
        task_id = self._task_id
        name = getattr(fn, "__qualname__", repr(fn))
        offsets = [os.path.getsize(log) if os.path.exists(log) else 0 for log in self._logs]
        for conn in self._conns:
            conn.send(("run", task_id, payload))
        started = time.monotonic()
        replies = self._collect(started + timeout)
        unanswered = [r for r in range(self.world_size) if r not in replies]
        if unanswered:
            answered = sorted(replies)
            detail = self._describe_unanswered(unanswered, name, offsets)
            self._kill()
            raise RankTimeout(
                f"{name} timed out after {timeout:.1f} s on {self.world_size} ranks: ranks {unanswered} did not answer "
                f"(ranks {answered} did). A rank waiting in a collective that another rank never joined looks like "
                f"this. The pool will be restarted.\n{detail}"
            )
        failures = []
        for rank in range(self.world_size):
            status, _, value = replies[rank][:3]
            if status == "error":
                failures.append(f"--- rank {rank} ---\n{value}")
            elif status == "died":
                failures.append(f"--- rank {rank} died (exit code {value}) ---\n{self._log_since(rank, offsets[rank])}")
        if failures:
            # A failed body may have left ranks out of step in the group: start afresh.
            self._kill()
            raise RankFailure(
                f"{name} failed on {len(failures)} of {self.world_size} ranks:\n" + "\n".join(failures),
                {rank: reply[2] for rank, reply in replies.items() if reply[0] == "ok"})
        if max(reply[3] for reply in replies.values()) > _MAX_GLOO_THREADS:
            # NOTE: destroyed groups that torch still holds keep their gloo threads polling (worker.py): a long
            # suite's ranks would spend a good part of the two cores on them. Fresh ranks for the next body.
            self._kill()
        return [replies[rank][2] for rank in range(self.world_size)]
