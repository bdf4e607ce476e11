"""The plan of an element-wise op on wrapper tensors of one slab layout, read from their metadata on every call.

Where every tensor operand of an element-wise function is a wrapper tensor of one slab spec and one shard shape (no
plain tensor to broadcast or slice, no other layout or size to move, no tensor among the keywords), its rule's step
is torch's op on the shards, the result taking that spec, on any number of ranks. That takes a few attribute reads to
see, less than looking a kept answer up by signature (``dispatch.kept``), so ``KeptCalls`` asks this first for the
functions ``plan_elementwise`` was told of, and keeps answers by signature for every other call.

Usage (``ops.pointwise`` tells it its element-wise functions; ``dispatch.kept`` runs it)::

    plan_elementwise(torch.relu)
    out = ELEMENTWISE_PLANS.run(torch.relu, (xs,), {})     # NotImplemented: the signature path answers
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass
from mesh3d.domain.core.alike_ops import wrapper_like
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper
from mesh3d.domain.dispatch.registry import RULES, op_name
from mesh3d.domain.dispatch.writes import fresh_layout

__all__ = ["ELEMENTWISE_PLANS", "ElementwisePlans", "plan_elementwise"]

_Tensor = torch.Tensor


class ElementwisePlans:
    """The element-wise functions answered from their operands' metadata, with the slab rule each had when told.

    Usage: ``ELEMENTWISE_PLANS.applies(torch.relu)``; ``ELEMENTWISE_PLANS.run(torch.relu, (xs,), {})``
    """

    def __init__(self) -> None:
        self._rules: dict[Callable, Any] = {}
        #: The last spec found to be a slab (element-wise chains keep one spec object: one identity check serves)
        self._slab: Any = None

    def tell(self, func: Callable) -> None:
        """Answer ``func`` (ruled for slabs already, writing nothing) from its operands' metadata while its rule is
        the one it has now."""
        rule = RULES.get(func)
        if rule is None:  # NOTE: a call without a rule must reach the dispatcher, which refuses it by name
            raise ValueError(f"{op_name(func)} has no slab rule: only the calls the dispatcher rules have a plan")
        self._rules[func] = rule

    def applies(self, func: Callable) -> bool:
        """Whether ``func`` was told and keeps the rule it had then (a rule registered over it takes every call)."""
        rule = self._rules.get(func)
        return rule is not None and RULES.get(func) is rule

    def forget(self) -> None:
        """Let the last slab spec go with its mesh (``DistributedManager.on_shutdown``)."""
        self._slab = None

    def run(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """torch's op on the shards, laid out as its operands; ``NotImplemented`` where the plan does not apply."""
        like = None
        for a in args:
            if isinstance(a, _Tensor):
                if type(a) is not WrappedDomainTensor:
                    return NotImplemented
                if like is None:
                    like = a
                elif (a._spec is not like._spec and a._spec != like._spec) or a._whole != like._whole:
                    return NotImplemented  # NOTE: one spec and one whole shape: one shard shape
        if like is None:
            return NotImplemented
        recorded = False  # whether autograd records the call (a wrapper argument requires grad, grad mode on)
        if torch.is_grad_enabled():
            with disable_torch_function_subclass():  # NOTE: a wrapper's flag read through the dispatcher
                for a in args:
                    if type(a) is WrappedDomainTensor and a.requires_grad:
                        recorded = True
                        break
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, _Tensor):
                    return NotImplemented
        spec = like._spec
        if spec is not self._slab:
            if type(spec) is not DomainSpec or spec.dim is None or spec.outer != 1 or sum(spec.sizes) == 1:
                return NotImplemented  # NOTE: results of global length 1 become replicated: the rule's to say
            self._slab = spec
        # NOTE: torch's op on the shards: recorded (a gradient wanted), on their differentiable aliases behind the
        # result's one edge, as a rule's step is (``fresh_wrapper``), so its backward runs on plain shards; else
        # without any edge. Recorded on the wrappers instead, below autograd, each op cost a round trip through the
        # floor forward and one per backward formula (12-15 us each on the CPU)
        shards = [(a._differentiable_local() if recorded else a._local) if type(a) is WrappedDomainTensor else a
                  for a in args]
        try:
            out = func(*shards, **kwargs)
        except Exception:  # noqa: BLE001 - NOTE: the dispatcher runs it again, raising the error and telling the peers
            return NotImplemented
        if type(out) is not _Tensor or out.shape != like._local.shape or out._base is not None:
            return NotImplemented
        for a in shards:
            if a is out:  # NOTE: not a fresh result (``x.float()`` of a float x is x): the dispatcher's
                return NotImplemented
        if not recorded:
            made = wrapper_like(WrappedDomainTensor, out, like)
            if made is not None:  # NOTE: laid out as its operand (the one-process layout of an element-wise result
                return made  # of a dense one): nothing left open
            made = WrappedDomainTensor(out, spec)
        else:
            made = fresh_wrapper(out, spec)
        return made if made._local.shape == made._whole else fresh_layout(made, func, args, kwargs)


#: The element-wise plans of this process (``dispatch.kept`` runs them)
ELEMENTWISE_PLANS = ElementwisePlans()


def plan_elementwise(func: Callable) -> None:
    """Give ``func`` (an element-wise function, ruled already, writing nothing) its plan from metadata.

    Usage: ``plan_elementwise(torch.relu)``
    """
    ELEMENTWISE_PLANS.tell(func)
