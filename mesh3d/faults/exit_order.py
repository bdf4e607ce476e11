"""The order in which ranks that share an error end, under torchrun: every one of them gets to the error, then the one
that reported it ends, then the others.

torchrun's agent polls its workers; when it sees one fail it sends SIGTERM to every worker still running. Ranks that
raise the same error (``summary.mark_shared``: a mesh that does not fit the world, a checkpoint that is not there) get
there at different times, seconds apart on a busy machine (imports alone). Without an order:

- the reporting rank could end while another was still importing: the other is ended by torchrun's signal, not by the
  error every rank shares;
- a quiet rank could end first, and torchrun could then end the reporting rank before it printed the cause: the user
  would see a failure with no reason.

So each rank says it has arrived at the shared error in the store torchrun's agent already runs for its workers
(``TORCHELASTIC_USE_AGENT_STORE``: no collective, no group, bounded waits); the reporting rank prints at once, waits
(bounded) until every rank has arrived, and says it is done as the last thing before its process ends; the quiet
ranks end after that. Outside torchrun (SLURM, a plain process) there is no agent store: a quiet rank ends
``QUIET_EXIT_DELAY_S`` after its own error instead.

Usage (``ErrorSummary`` does this)::

    order = ExitOrder.under_torchrun(ranks)      # None outside torchrun
    order.arrive(); ...; order.wait_for_arrivals(); order.done()          # the reporting rank
    order.arrive(); ...; order.wait_until_done()                          # every other rank
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["ARRIVAL_WAIT_S", "DONE_WAIT_S", "QUIET_EXIT_DELAY_S", "ExitOrder"]

#: How long the reporting rank waits for the others to arrive at the error (a peer stuck elsewhere costs this once).
ARRIVAL_WAIT_S = 60.0
#: How long a quiet rank waits for the reporting rank to end (it may have been ended by a signal).
DONE_WAIT_S = 60.0
#: Outside torchrun: how long a rank that does not report waits at exit, so the reporting rank ends first.
QUIET_EXIT_DELAY_S = 1.0
_CONNECT_S = 10.0
_POLL_S = 0.05


class ExitOrder:
    """Keys in torchrun's agent store for one shared error of one attempt of one run."""

    def __init__(self, store: dist.Store, prefix: str, count: int) -> None:
        self._store, self._prefix, self._count = store, prefix, count

    @classmethod
    def under_torchrun(cls, ranks: tuple[int, ...]) -> ExitOrder | None:
        """The order for an error shared by ``ranks``, or None where no torchrun agent store is reachable."""
        env = os.environ
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or "MASTER_PORT" not in env:
            return None
        try:
            store = dist.TCPStore(env.get("MASTER_ADDR", "localhost"), int(env["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=_CONNECT_S))
        except (RuntimeError, ValueError, OSError):
            return None
        run = env.get("TORCHELASTIC_RUN_ID", "")
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"mesh3d/shared_error/{run}/{attempt}/" + ",".join(map(str, ranks))
        return cls(store, prefix, len(ranks))

    # NOTE: these run in an exception hook and at exit: a store that went away (the agent ended) must not add an
    # error of its own to the one being reported, so each gives up quietly.
    def arrive(self) -> bool:
        """This rank has got to the shared error."""
        try:
            self._store.add(f"{self._prefix}/arrived", 1)
        except (RuntimeError, OSError):
            return False
        return True

    def wait_for_arrivals(self, wait_s: float = ARRIVAL_WAIT_S) -> bool:
        """Wait until every rank sharing the error has arrived (at most ``wait_s``); True if all did."""
        deadline = time.monotonic() + wait_s
        try:
            while self._store.add(f"{self._prefix}/arrived", 0) < self._count:
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_S)
        except (RuntimeError, OSError):
            return False
        return True

    def done(self) -> bool:
        """The reporting rank is about to end."""
        try:
            self._store.set(f"{self._prefix}/done", "1")
        except (RuntimeError, OSError):
            return False
        return True

    def wait_until_done(self, wait_s: float = DONE_WAIT_S) -> bool:
        """Wait until the reporting rank says it is done (at most ``wait_s``); True if it did."""
        try:
            self._store.wait([f"{self._prefix}/done"], timedelta(seconds=wait_s))
        except (RuntimeError, OSError):
            return False
        return True
