"""What ``mesh3d.domain`` changes in torch for the whole process, installed while a domain tensor can exist.

Usage (``mesh3d.domain`` wires it; nothing to call)::

    LIVE_COMMS.watch(on_first=PROCESS_HOOKS.install, on_none=PROCESS_HOOKS.remove)
    PROCESS_HOOKS.installed  # True while any DomainComm (so possibly a domain tensor) is alive

Three things cannot be reached from a domain tensor's own ``__torch_function__``, so they are changed in torch:
* ``torch.autograd.Function.apply``: a library's Function called with a domain tensor is sent to the dispatcher
  (ruled, run as torch's or mesh3d's own, or refused), not run on the shard unseen
  (``_torch_private.route_autograd_function_calls``);
* AOTAutograd's first-call aliasing check of custom ops, which refuses ``__torch_function__`` subclasses, is off
  (``_torch_private.let_compiled_graphs_take_function_subclasses``);
* activation checkpointing recomputes a region as its forward ran: domain tensor inputs rebuilt, the attention mode
  and overlap in force (``recompute.py``).

NOTE: not on import (issue 66): ``import mesh3d.checkpoint`` imports this package, and a process that only saves a
plain model must get torch unchanged. Every domain tensor's spec holds a ``DomainComm``, so the hooks go in when the
first comm is made (before any domain tensor) and come out when the last one is collected (after the last domain
tensor); ``LiveComms`` in ``core/group.py`` counts them.
"""

from __future__ import annotations

import sys

from mesh3d._torch_private import (
    let_compiled_graphs_take_function_subclasses, route_autograd_function_calls, unpatch_checkpoint_recomputation,
    unroute_autograd_function_calls)
from mesh3d.domain import recompute
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.wrapped import WrappedDomainTensor
from mesh3d.domain.dispatch.dispatcher import dispatch_autograd_function

__all__ = ["PROCESS_HOOKS", "ProcessHooks"]


class ProcessHooks:
    """The process-wide changes above, each undone by ``remove`` as it was before ``install``.

    Usage: ``PROCESS_HOOKS.install(); ...; PROCESS_HOOKS.remove()``
    """

    def __init__(self) -> None:
        self.installed = False
        self._aliasing_check_was_off = False

    def install(self) -> None:
        if self.installed:
            return
        self._aliasing_check_was_off = let_compiled_graphs_take_function_subclasses(True)
        route_autograd_function_calls((DomainTensor, WrappedDomainTensor), dispatch_autograd_function)
        recompute.install()
        self.installed = True

    def remove(self) -> None:
        if not self.installed or sys.is_finalizing():
            # NOTE: at exit (a domain tensor in a reference cycle, collected as the interpreter tears its modules
            # down) nothing is left to undo, and an import there printed "Exception ignored ... sys.meta_path is None"
            return
        unpatch_checkpoint_recomputation()
        unroute_autograd_function_calls()
        let_compiled_graphs_take_function_subclasses(self._aliasing_check_was_off)
        self.installed = False


PROCESS_HOOKS = ProcessHooks()
