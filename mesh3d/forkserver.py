"""The forkserver local ranks are forked from, started before a command's own imports (no torch here).

Local ranks (``mesh3d check``'s, ``mesh3d.planner.launch.LocalRanks``) are forked from a server process that imported
torch and mesh3d once, instead of each importing them (seconds of CPU per rank on a small machine). A command that will
start local ranks calls ``start()`` first thing, so the server's imports run beside the command's own on another core.

Usage::

    start()                                        # sets the preload, starts the server; returns at once
    ctx = multiprocessing.get_context("forkserver")  # then: ctx.Process(...) forks from it
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

__all__ = ["PRELOAD", "start"]

#: What every local rank imports anyway, imported once by the server.
PRELOAD = ("torch", "torch.distributed", "mesh3d.planner.check_run", "mesh3d.planner.launch")


def start() -> None:
    """Set the server's preload and start it (this process's one forkserver; a no-op once it runs).

    NOTE: the preload is the forkserver's, for the whole process: where the caller started one already, that one
    serves (it imported what its own caller asked; the ranks import the rest).
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
