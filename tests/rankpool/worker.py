"""The loop each pooled rank runs: join the gloo group once, then run test bodies forever.

A rank's stdout/stderr go to its own log file, and SIGUSR1 makes it dump every
thread's stack there, so the parent can show where a hung rank is stuck.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

#: Sent by the parent to a rank that has not answered in time.
DUMP_SIGNAL = signal.SIGUSR1


def _redirect_output(log_path: str) -> Any:
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=log, all_threads=True)
    return log


def _check_default_group(world_size: int) -> None:
    """The pool's own group must outlive every body (a body that destroyed it would break the next test)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise RuntimeError("the test body destroyed or replaced the pool's default process group")


def gloo_loop_threads() -> int:
    """This process's gloo transport threads: one per gloo group still alive in C++, destroyed or not.

    NOTE: a destroyed gloo group lives on while anything in torch still holds it (for example the last mesh's
    FSDP or DTensor state), and its thread wakes about a hundred times a second: a rank that ran hundreds of
    bodies spends a tenth of a core on groups it no longer uses. The pool recycles such ranks (pool.py).
    """
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return names.count("gloo_tcp_loop")


def _exit_with(parent: int) -> None:
    """End this rank when the pytest process that owns the pool is gone (killed, or ended by a CI time limit): a rank
    left in a body's collective otherwise polls its gloo threads, a core's share among a few of them, for ever."""
    def watch() -> None:
        while True:
            time.sleep(2.0)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(3)
    threading.Thread(target=watch, name="rankpool-parent-watch", daemon=True).start()


def worker_main(rank: int, world_size: int, store_port: int, conn: Any, log_path: str, pg_timeout_s: float,
                parent: int) -> None:
    """Entry point of one pooled rank (runs in a process forked from the forkserver)."""
    log = _redirect_output(log_path)
    _exit_with(parent)
    import torch
    import torch.distributed as dist

    from rankpool.state import ProcessState

    # Several ranks share two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    store = dist.TCPStore("127.0.0.1", store_port, None, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
    )
    # NOTE: captured once the rank is set up, restored after every body: no body sees what an earlier one left
    # (rankpool/state.py lists what that covers), so the suite passes in any order.
    clean = ProcessState.capture(whole_process=True)
    clean.restore()
    # NOTE: what the rank holds now (torch, and the libraries the forkserver preloads: about 620k objects) never
    # becomes garbage; frozen, the collection after every body (below) and the automatic ones skip it. Unfrozen,
    # each collection walked all of it: 0.14 s without the preload, 0.39 s with it (measured, cores busy), after every
    # body on every rank, and its reference bookkeeping wrote to pages the rank shares with the forkserver.
    gc.freeze()
    conn.send(("ready", rank))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        _, task_id, payload = message
        try:
            fn, args, kwargs = pickle.loads(payload)
            print(f"--- task {task_id}: {getattr(fn, '__qualname__', fn)}", flush=True)
            reply = ("ok", task_id, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - every failure is reported to the parent
            reply = ("error", task_id, traceback.format_exc())
        try:
            clean.restore()
            # NOTE: a body's mesh groups, once shut down, are still held in reference cycles (modules with FSDP's
            # hooks, closures): their gloo threads polled on until the cyclic collector ran, and a rank passed the
            # recycling limit every ~8 bodies (70 pool restarts in one suite). Collected here, they go at once.
            gc.collect()
            _check_default_group(world_size)
        except BaseException:  # noqa: BLE001
            earlier = reply[2] + "\n" if reply[0] == "error" else ""
            reply = ("error", task_id, earlier + "cleanup after the test body failed:\n" + traceback.format_exc())
        reply = (*reply, gloo_loop_threads())
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", task_id, "could not send the result back:\n" + traceback.format_exc(),
                       gloo_loop_threads()))
    dist.destroy_process_group()
    log.close()
