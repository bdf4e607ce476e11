"""``NestedDispatchCheck``: find rules that call torch on a domain tensor through torch's dispatch, not ``redispatch``.

Usage::

    with NestedDispatchCheck() as check:
        loss = model(xs).sum(); loss.backward()
    assert not check.found, check.found      # ["torch.Tensor.select at mesh3d/domain/ops/idioms.py:132", ...]

Why: eager torch sends a torch call made inside ``__torch_function__`` back to it, so a rule may write ``x.shape``
or ``a - b`` on domain tensors and get the domain answer. Dynamo (torch 2.13) turns subclass dispatch off while it
traces a ``__torch_function__``: compiled, the same line would run on the shard as a plain op, silently local.
Rules therefore read sizes with ``tensor.size_of`` and call ops with ``dispatch.redispatch``; this check, run
eagerly over the models the compile tests use, finds a line that does not.
"""

from __future__ import annotations

import traceback
from typing import Any

from mesh3d.domain.dispatch.queries import METADATA
from mesh3d.domain.dispatch.registry import op_name
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["NestedDispatchCheck"]


class NestedDispatchCheck:
    """While active, every torch call on a domain tensor made from inside a rule through torch's dispatch is noted
    in ``found`` (the op and the calling line); metadata queries (``.dtype``, ``.ndim``) are the same either way."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._depth = 0
        self._inner: Any = None

    def __enter__(self) -> NestedDispatchCheck:
        self._inner = DomainTensor._dispatcher
        DomainTensor._dispatcher = self._checked
        return self

    def __exit__(self, *exc: object) -> None:
        DomainTensor._dispatcher = self._inner

    def _checked(self, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        if self._depth and func not in METADATA:
            caller = traceback.extract_stack(limit=3)[0]
            self.found.append(f"{op_name(func)} at {caller.filename}:{caller.lineno}")
        self._depth += 1
        try:
            return self._inner(func, types, args, kwargs)
        finally:
            self._depth -= 1
