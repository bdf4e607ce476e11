"""The peer watch: heartbeats through the job's store, so every survivor names a lost or hung rank in bounded time.

Usage (the manager owns one; ``DistributedManager.initialize`` starts it on every rank of a world of two or more)::

    with dm.guard("train step"):       # raises PeerLostError / CollectiveTimeoutError instead of gloo's raw error
        train_step(batch)
    dm.watch.check()                   # raises PeerLostError at once if any rank is known to be lost

How a loss is learnt, fastest first (docs/troubleshooting.md, "A rank died or hangs"):

1. a rank that fails inside ``dm.guard`` (or with an uncaught exception) marks its heartbeat failed, with the
   error, and announces it: every watcher reads it at its next tick (``interval``);
2. a rank whose collective saw a connection close (gloo, when a peer's process ends) looks for the silent peer
   with a short limit (``suspect_after``) and announces it;
3. a peer whose heartbeat has not moved for ``dead_after`` is lost, evidence or not (NCCL hangs rather than
   closing; a process hung holding the GIL stops beating).

A survivor whose main thread then stays blocked inside a collective for ``grace`` seconds cannot be woken (gloo
has no abort: gloo#388): the watch prints the same named error and ends the process with ``PEER_LOST_EXIT_CODE``,
so the launcher restarts the job instead of waiting out the group timeout. A peer that is alive but never
arrives keeps beating; the group timeout ends the wait, and ``guard`` names where each rank was.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from mesh3d.faults.beat import ALIVE, DONE, FAILED, Beat, main_thread_where
from mesh3d.faults.errors import PEER_LOST_EXIT_CODE, STORE_RANK, CollectiveTimeoutError, PeerLostError
from mesh3d.faults.settings import WatchSettings

__all__ = ["NO_WATCH", "PeerWatch", "WatchSettings", "closed_connection", "timed_out"]

#: What transports say when the other end went away (gloo's pairs, NCCL's remote errors).
_CLOSED = ("connection closed", "connection reset", "broken pipe", "connection refused", "socket closed",
           "ncclremoteerror", "remote process exited")
_TIMED_OUT = ("timed out", "timeout")
#: Ranks listed one by one in a timeout report; beyond this, only the ones not waiting in a collective.
_LIST_ALL_UP_TO = 64


def closed_connection(err: BaseException) -> bool:
    """Whether ``err`` says the other end of a connection went away."""
    return any(s in str(err).lower() for s in _CLOSED)


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` is a collective's or a store's timeout."""
    return any(s in str(err).lower() for s in _TIMED_OUT)


class PeerWatch:
    """This rank's heartbeat thread and what it has learnt about its peers (``lost``: {rank: reason})."""

    def __init__(self, connection: dist.Store, rank: int, world_size: int, describe: Callable[[int], str],
                 settings: WatchSettings) -> None:
        """``connection``: a client of the job's store that only watches use (``store.clone()``)."""
        self.rank, self.world_size, self.settings, self.describe = rank, world_size, settings, describe
        self.lost: dict[int, str] = {}
        #: False once a store operation failed: the connection may be out of step (``ended_sound``)
        self.connection_sound = True
        # NOTE: a generation per mesh: keys from an earlier mesh in this job's store (a test pool's, a restarted
        # manager's) must not be read as this one's. Every rank joins each mesh once, in the same order.
        generation = (connection.add("mesh3d/watch/joined", 1) - 1) // world_size
        self._store = dist.PrefixStore(f"mesh3d/watch/{generation}", connection)
        self._store.set_timeout(timedelta(seconds=max(2.0, 2 * settings.interval)))
        self._lock = threading.RLock()  # the store client and the state below
        self._doing, self._guards, self._seq, self._status, self._detail = "", 0, 0, ALIVE, ""
        self._seen: dict[int, tuple[int, float]] = {}
        self._watched: list[int] = []
        self._announcements_read = 0
        self._lost_since: float | None = None
        self._acknowledged = False
        self._evidence = False
        self._store_ok_at = time.monotonic()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat()  # before the mesh's first collective: once it completes, every peer's key exists

    def begin(self, watched: list[int]) -> None:
        """Start beating and watching ``watched`` (global ranks; call after a collective every rank joined)."""
        self._watched = [r for r in sorted(set(watched)) if r != self.rank]
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in self._watched}
        self._thread = threading.Thread(target=self._run, name="mesh3d-peer-watch", daemon=True)
        self._thread.start()

    def ended_sound(self) -> bool:
        """Stopped as a clean shutdown does: done, no peer lost, every store operation answered."""
        return self._status == DONE and not self.lost and self.connection_sound

    def stop(self) -> None:
        """Stop the thread; the last beat says this rank shut down (unless it failed)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * max(self.settings.interval, 0.1))
        with self._lock:
            self._status = FAILED if self._status == FAILED else DONE
            try:
                self._beat()
            except (RuntimeError, OSError):
                self.connection_sound = False  # the store is gone: nobody is left to tell

    # -- the main thread's side -----------------------------------------------------------------------------------

    @contextmanager
    def doing(self, label: str) -> Iterator[None]:
        """Label what this rank's main thread is doing, for its heartbeat and its peers' errors (other threads: no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous, self._doing = self._doing, label
        try:
            yield
        finally:
            self._doing = previous

    @contextmanager
    def guard(self, label: str = "a step") -> Iterator[None]:
        """Run a block whose collectives' failures are named: a lost peer, a timeout with every rank's position."""
        previous, self._doing = self._doing, label
        self._guards += 1
        try:
            self.check()
            yield
        except PeerLostError as err:
            self._acknowledged = True
            # NOTE: a loss this rank learnt first-hand (a domain exchange saw the connection close) is announced, so
            # survivors that do not watch the lost rank (on another batch row) name it at their next tick instead of
            # blaming the first rank whose collective failed.
            for rank, reason in err.lost.items():
                self._declare(rank, reason)
            raise
        except CollectiveTimeoutError:
            self._acknowledged = True
            raise
        except RuntimeError as err:
            named = self.translate(err)
            if named is err:
                self.report_failure(err)
                raise
            raise named from err
        except BaseException as err:
            self.report_failure(err)
            raise
        finally:
            self._guards -= 1
            self._doing = previous

    def check(self) -> None:
        """Raise ``PeerLostError`` if any rank is known to be lost (cheap: one attribute read when none is)."""
        if self.lost:
            self._acknowledged = True
            raise PeerLostError.naming(self.lost, self.describe, self._doing, None)

    def translate(self, err: BaseException) -> BaseException:
        """The named error for a collective's raw failure, or ``err`` itself when it is not about peers."""
        if closed_connection(err) or self.lost:
            self._evidence = True
            deadline = time.monotonic() + self.settings.suspect_after + 2 * self.settings.interval
            while not self.lost and time.monotonic() < deadline and self._thread is not None:
                time.sleep(self.settings.interval / 4)
            if self.lost:
                self._acknowledged = True
                return PeerLostError.naming(self.lost, self.describe, self._doing, err)
            if closed_connection(err):
                # NOTE: the connection closed and no peer's process ended: a peer gave up on its own (its collective
                # timed out first, and gloo closes a pair it timed out on). What went wrong is what a timeout says:
                # a rank that does not arrive, named by the heartbeats. The raw error named only a port.
                self._acknowledged = True
                return self.timeout_error(err, closed=True)
        if timed_out(err):
            self._acknowledged = True
            return self.timeout_error(err)
        return err

    def report_failure(self, err: BaseException) -> None:
        """Mark this rank failed (its error in the heartbeat) and announce it, so peers stop waiting for it."""
        detail = _one_line(err)
        with self._lock:
            if self._status == FAILED:
                return
            self._status, self._detail = FAILED, detail
            self._acknowledged = True
            try:
                self._beat()
                self._announce(self.rank, f"failed with {detail} while {self._doing or 'between steps'}")
            except (RuntimeError, OSError):
                pass

    def publish_error(self, err: BaseException, during: str) -> None:
        """Leave this rank's error where peers can read it (``error_of``) before they learn that it stopped."""
        with self._lock:
            try:
                self._store.set(f"error/{self.rank}", f"{_one_line(err)} in {during}")
            except (RuntimeError, OSError):
                pass

    def known_lost(self) -> dict[int, str]:
        """Every rank known lost, announcements read now: a watch thread starved on a busy machine may not have."""
        with self._lock:
            try:
                self._read_announcements()
            except (RuntimeError, OSError):
                pass
            return dict(self.lost)

    def error_of(self, rank: int) -> str:
        """The error ``rank`` published last, or "" (unknown, or the store is gone)."""
        with self._lock:
            try:
                key = f"error/{rank}"
                return self._store.get(key).decode() if self._store.check([key]) else ""
            except (RuntimeError, OSError):
                return ""

    def timeout_error(self, err: BaseException, closed: bool = False) -> CollectiveTimeoutError:
        """A timeout, with what every rank was doing and where its main thread was (from the heartbeats); ``closed``:
        this rank saw a live peer close its connection (that peer timed out first)."""
        beats = self._read_beats([r for r in range(self.world_size) if r != self.rank])
        mine = Beat(seq=self._seq, status=self._status, doing=self._doing, where=main_thread_where()[0], waiting=True)
        beats[self.rank] = mine
        where = {r: (b.describe() if b.status == ALIVE else f"{b.status} {b.detail}".strip()) for r, b in beats.items()}
        suspects = [r for r, b in sorted(beats.items()) if not b.waiting or b.status != ALIVE]
        shown = sorted(where) if len(where) <= _LIST_ALL_UP_TO else suspects
        lines = "\n".join(f"  {self.describe(r)}: {where[r]}" for r in shown)
        hint = (f"Not waiting in a collective: {', '.join(self.describe(r) for r in suspects)}: the likely hang."
                if suspects else "Every rank is waiting in a collective: they wait in different ones (a program "
                "that diverged), or the ranks without a heartbeat here are the hang.")
        what = "a peer gave up on a collective (it closed its connection; no rank is lost)" if closed else \
            "a collective timed out"
        return CollectiveTimeoutError(
            f"{what} while this rank ({self.describe(self.rank)}) was {self._doing or 'between steps'}"
            f" ({type(err).__name__}: {str(err).strip().splitlines()[0][:160]}). {hint} Where each rank was:\n{lines}\n"
            "Choose the timeout with DistributedManager.initialize(timeout=...) or MESH3D_TIMEOUT "
            "(docs/troubleshooting.md, 'A rank died or hangs').", where)

    # -- the watch thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.wait(self.settings.interval):
            try:
                with self._lock:
                    self._tick()
                self._store_ok_at = time.monotonic()
            except (RuntimeError, OSError, ValueError) as err:  # the store is unreachable (its host is gone)
                self.connection_sound = False
                silent = time.monotonic() - self._store_ok_at
                if silent > (self.settings.suspect_after if self._evidence else self.settings.dead_after):
                    self._declare(STORE_RANK, f"unreachable for {silent:.0f} s ({type(err).__name__})", announce=False)
            self._maybe_fail_stop()

    def _tick(self) -> None:
        self._beat()
        self._read_announcements()
        now = time.monotonic()
        limit = self.settings.suspect_after if self._evidence else self.settings.dead_after
        for rank, beat in self._read_beats(self._watched).items():
            seq, since = self._seen[rank]
            if beat.seq != seq:
                self._seen[rank] = (beat.seq, now)
            if beat.status == FAILED:
                self._declare(rank, f"failed with {beat.detail} while {beat.doing or 'between steps'}")
            elif beat.status == ALIVE and beat.seq == seq and now - since > limit:
                self._declare(rank, f"no heartbeat for {now - since:.1f} s (killed, or hung holding the GIL); last "
                                    f"heard {beat.describe()}")

    def _beat(self) -> None:
        where, waiting = main_thread_where()
        self._seq += 1
        beat = Beat(seq=self._seq, status=self._status, doing=self._doing, where=where, waiting=waiting,
                    detail=self._detail)
        self._store.set(f"beat/{self.rank}", beat.encode())

    def _read_beats(self, ranks: list[int]) -> dict[int, Beat]:
        if not ranks:
            return {}
        with self._lock:
            try:
                raw = self._store.multi_get([f"beat/{r}" for r in ranks])
            except (RuntimeError, OSError):
                self.connection_sound = False
                return {}
        return {r: Beat.decode(value) for r, value in zip(ranks, raw)}

    def _announce(self, rank: int, reason: str) -> None:
        n = self._store.add("lost_count", 1)
        self._store.set(f"lost/{n}", json.dumps({"rank": rank, "reason": reason, "by": self.rank}))

    def _read_announcements(self) -> None:
        count = self._store.add("lost_count", 0)
        while self._announcements_read < count:
            key = f"lost/{self._announcements_read + 1}"
            if not self._store.check([key]):
                break  # announced, not yet written: next tick
            record = json.loads(self._store.get(key))
            self._announcements_read += 1
            seen = "" if record["by"] == record["rank"] else f" (seen by {self.describe(record['by'])})"
            self._declare(record["rank"], record["reason"] + seen, announce=False)

    def _declare(self, rank: int, reason: str, announce: bool = True) -> None:
        with self._lock:
            if rank == self.rank or rank in self.lost:
                return
            self.lost[rank] = reason
            self._lost_since = self._lost_since or time.monotonic()
            if announce:
                try:
                    self._announce(rank, reason)
                except (RuntimeError, OSError):
                    pass

    def _maybe_fail_stop(self) -> None:
        """End this process if a loss is known, unacknowledged, and the main thread stays stuck in a collective."""
        if not self.lost or self._acknowledged or self._stopped.is_set() or self._lost_since is None:
            return
        if time.monotonic() - self._lost_since < self.settings.grace:
            return
        where, waiting = main_thread_where()
        if not (waiting or self._guards):
            return  # the main thread is not stuck: its next check() or guard raises
        error = PeerLostError.naming(self.lost, self.describe, self._doing, None)
        print(f"mesh3d: {self.describe(self.rank)}: PeerLostError: {error}\nIts main thread stayed blocked at {where} "
              f"for {self.settings.grace:.0f} s after the loss, and a collective cannot be interrupted there; this "
              f"process ends now with exit status {PEER_LOST_EXIT_CODE}.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(PEER_LOST_EXIT_CODE)


def _one_line(err: BaseException, limit: int = 400) -> str:
    """The error in one line: its lines joined (an agreed error's first line says what failed, the next ones name the
    rank each cause came from: a peer that reads only the first learns nothing of where the fault was)."""
    text = "; ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"{type(err).__name__}: {text if len(text) <= limit else text[:limit - 3] + '...'}"


class _NoWatch:
    """The watch of a world of one, or with ``MESH3D_HEARTBEAT=0``: nothing to watch; errors pass unchanged."""

    lost: dict[int, str] = {}

    def begin(self, watched: list[int]) -> None:
        pass

    def ended_sound(self) -> bool:
        return False

    def stop(self) -> None:
        pass

    @contextmanager
    def doing(self, label: str) -> Iterator[None]:
        yield

    @contextmanager
    def guard(self, label: str = "a step") -> Iterator[None]:
        yield

    def check(self) -> None:
        pass

    def translate(self, err: BaseException) -> BaseException:
        return err

    def report_failure(self, err: BaseException) -> None:
        pass

    def publish_error(self, err: BaseException, during: str) -> None:
        pass

    def known_lost(self) -> dict[int, str]:
        return {}

    def error_of(self, rank: int) -> str:
        return ""


#: The watch when there is none.
NO_WATCH = _NoWatch()
