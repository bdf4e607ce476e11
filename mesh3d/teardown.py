"""Teardown of the distributed state, in one order, at ``DistributedManager.shutdown()`` and at interpreter exit.

Usage: not called directly. ``DistributedManager`` owns one ``Teardown``; other parts of mesh3d register what
must finish before the groups go (``DistributedManager.on_teardown(IN_FLIGHT.finish)``).

Why it exists (docs/troubleshooting.md, "The process aborts at exit"): a gloo process group runs its
collectives on worker threads (``pt_gloo_runloop``). ``work.wait()`` returns as soon as a collective is
done, but the worker releases the finished work, and with it the tensors the caller passed, a moment
later. Releasing a tensor that has a Python object takes the GIL; if the interpreter has begun to finalize
by then, CPython ends the thread inside that C++ destructor and the process dies with ``terminate called
without an active exception`` (SIGABRT), after correct results. ``destroy_process_group`` does not prevent
it: for gloo it only unregisters the group (the backend's ``shutdown()`` does nothing), and the group, with
its threads, lives on while anything holds it (FSDP2's state on a model does).

The fix is a *drain*: posting any collective on a gloo group takes the lock its worker holds while it
releases the previous work, so once a barrier is posted on a group every earlier release on it is done;
the barrier itself holds no tensor with a Python object. Teardown therefore, in this order:

1. finishes background work (a pending background save: the ``on_teardown`` hooks);
2. completes or gives up on pending point-to-point notices (domain divergence notices: also a hook);
3. drains every gloo group it is about to leave (one barrier each, all posted before any is waited on,
   bounded by a timeout: a late or dead peer costs at most that long, never a hang);
4. destroys the groups (``DistributedManager.shutdown``);
5. forgets per-mesh state (the ``on_shutdown`` hooks).

At interpreter exit the same runs from an ``atexit`` handler, while the interpreter is still whole, for
every live group, so a script that never calls ``shutdown()`` exits cleanly too.
"""

from __future__ import annotations

import atexit
import logging
import sys
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

from mesh3d._torch_private import gloo_backend, post_barrier

__all__ = ["Teardown", "SHUTDOWN_DRAIN_TIMEOUT", "EXIT_DRAIN_TIMEOUT_ON_ERROR", "exiting_on_error"]

#: How long ``shutdown()`` waits for the peers' drain barriers. The ranks of a healthy job reach shutdown
#: within this of each other; a rank that gives up earlier has still drained its own threads (posting is
#: what drains), so the only cost of a late peer is this wait, on the ranks that came first.
SHUTDOWN_DRAIN_TIMEOUT = timedelta(seconds=60)

#: The same wait at exit after an uncaught exception: peers may be stuck elsewhere, and the error should
#: reach the launcher soon. Ranks that failed together (mesh3d raises the same error on every rank) meet at once.
EXIT_DRAIN_TIMEOUT_ON_ERROR = timedelta(seconds=5)

# NOTE: plain logging, not mesh3d.log (which imports the manager, which imports this module).
_log = logging.getLogger(__name__)


def exiting_on_error() -> bool:
    """Whether the interpreter is exiting because of an uncaught exception (only meaningful at exit).

    Usage: ``timeout = short if exiting_on_error() else long``
    """
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


class Teardown:
    """The hooks that must run before groups are destroyed, the drain, and the one exit handler.

    Usage: ``teardown.add(hook)``; ``failures = teardown.finish_background_work()``;
    ``teardown.drain(groups, timeout)``; ``teardown.run_at_exit(callback)``.
    """

    def __init__(self) -> None:
        self._hooks: list[Callable[[], None]] = []
        self._exit_callback: Callable[[], None] | None = None

    def add(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` first at every teardown (it finishes work that still needs the groups)."""
        if hook not in self._hooks:
            self._hooks.append(hook)

    def finish_background_work(self) -> list[BaseException]:
        """Run every hook; a hook that fails does not stop the others. Returns the failures, in hook order."""
        failures: list[BaseException] = []
        for hook in self._hooks:
            try:
                hook()
            except BaseException as err:  # noqa: BLE001 - teardown must go on; the caller re-raises the first
                failures.append(err)
        return failures

    @staticmethod
    def drain(groups: Iterable[dist.ProcessGroup], timeout: timedelta) -> list[str]:
        """Post one barrier on each gloo group (this rank's worker threads are then idle), then wait for them.

        Returns a line per barrier that did not complete in ``timeout`` (a peer that left first or never came);
        those are harmless for this process, whose threads the posting already drained.
        """
        posted = []
        # NOTE: the backends are kept alive while we compare them: ``_get_backend`` hands out a new Python wrapper
        # when none is alive, and a freed wrapper's id is reused by the next one, so an id set of dropped wrappers
        # skipped a group now and then, on one rank and not its peer, whose barrier then waited out the timeout
        # (60 s at shutdown, about one shutdown in twenty after a background save)
        kept: dict[int, object] = {}
        for group in groups:
            backend = gloo_backend(group)
            if backend is None or id(backend) in kept:
                continue
            kept[id(backend)] = backend
            try:
                posted.append((group, post_barrier(backend, timeout)))
            except RuntimeError as err:  # a group whose peers are already gone: nothing left to drain
                posted.append((group, err))
        late = []
        for group, work in posted:
            if isinstance(work, BaseException):
                late.append(f"group {group.group_name}: {work}")
                continue
            try:
                work.wait()
            except RuntimeError as err:
                late.append(f"group {group.group_name}: {str(err).splitlines()[0][:200]}")
        return late

    def run_at_exit(self, callback: Callable[[], None]) -> None:
        """Register ``callback`` with ``atexit`` once per process (later calls are ignored).

        NOTE: ``atexit`` runs handlers last-registered first, and before the interpreter starts to finalize;
        this one is registered when the first mesh is built, so it runs before handlers registered earlier
        (a launcher's own ``destroy_process_group``) and after the user's later ones.
        """
        if self._exit_callback is None:
            self._exit_callback = callback
            atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        assert self._exit_callback is not None
        try:
            self._exit_callback()
        except BaseException:  # noqa: BLE001 - never turn a clean exit into a traceback from teardown
            _log.error("mesh3d: teardown at exit failed:\n%s", traceback.format_exc())
