"""Calls of ATen operators made from their schemas: the door-hunting test's inputs (``test_domain_operators.py``).

``door_overloads()`` lists every ATen overload whose name is that of a torch function with a domain rule (the ops a
model reaches through the rules, called directly instead). ``calls(overload, x, y)`` makes a few argument lists for one
from its schema: ``x`` as the first tensor, ``y`` (laid out like ``x``) or a scalar tensor as the others, and plain
values for the rest, with the sharded dim among the dims tried. An overload whose arguments it cannot make is skipped
(listed, so the test can say how many it reached).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mesh3d._torch_private import op_schema

#: Overloads no schema-made call can check against one process: random draws (another stream per process),
#: allocation and identity queries.
SKIP_NAMES = {"bernoulli", "bernoulli_", "dropout", "alpha_dropout", "feature_alpha_dropout", "feature_dropout", "rrelu",
              "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "exponential_", "random_", "cauchy_",
              "log_normal_", "geometric_", "kaiming_uniform_", "empty_like", "new_empty", "new_empty_strided", "data_ptr",
              "set_", "resize_", "resize_as_", "record_stream", "_version", "retains_grad", "requires_grad_",
              "untyped_storage", "storage_offset", "is_set_to", "cpu", "cuda", "pin_memory", "to", "type_as", "item"}


def door_overloads() -> list:
    """Every ATen overload named like a torch function that has a domain rule (in any layout's table) and taking a
    tensor first: the ones a domain tensor can be passed to."""
    from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, STRIDED_RULES, TOKEN_RULES

    names = set()
    for table in (RULES, STRIDED_RULES, BLOCK_RULES, TOKEN_RULES):
        for func in table:
            name = getattr(func, "__name__", None)
            if isinstance(name, str) and not name.startswith("__"):
                names.add(name)
    out = []
    for name in sorted(names - SKIP_NAMES):
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            first = op_schema(op).arguments[:1]
            if "out" in overload or torch.Tag.nondeterministic_seeded in op.tags or not first or \
                    str(first[0].type) not in ("Tensor", "List[Tensor]"):
                continue
            out.append(op)
    return out


def _values(arg: Any, x: torch.Tensor, y: torch.Tensor, sharded_dim: int) -> list | None:
    """Candidate values for one schema argument; None: none this module can make."""
    kind, name = str(arg.type), arg.name
    if name == "dtype":  # a ScalarType (TorchScript spells it int)
        return [None] if kind.startswith("Optional") else [x.dtype]
    if kind == "Tensor":
        return [y, torch.tensor(0.75, dtype=x.dtype)]
    if kind == "Optional[Tensor]":
        return [None]
    if kind == "List[Tensor]":
        return [[x, y]]
    if kind in ("number", "Optional[number]"):
        return [0.5] if kind == "number" else [None]
    if kind in ("int", "SymInt"):
        if "dim" in name:
            return [sharded_dim, 1, -1]
        return [1]
    if kind in ("List[int]", "List[SymInt]", "Optional[List[int]]", "Optional[List[SymInt]]"):
        if "dim" in name:
            return [[sharded_dim], [1, 3]] + ([None] if kind.startswith("Optional") else [])
        if name in ("size", "shape", "sizes"):
            return [list(x.shape), [x.shape[0], -1, x.shape[-1]]]
        if name in ("kernel_size", "stride", "padding", "dilation", "output_size"):
            return [[1] * (x.ndim - 2)]
        return [[1]]
    if kind == "bool":
        return [False, True] if name == "keepdim" else [False]
    if kind.startswith("Optional["):
        return [None]
    if kind == "float":
        return [0.5]
    return None


def calls(op: Any, x: torch.Tensor, y: torch.Tensor, sharded_dim: int, limit: int = 4) -> Iterator[tuple[tuple, dict]]:
    """Up to ``limit`` argument lists for ``op``: ``x`` first, then candidates for each argument (see module doc)."""
    schema = op_schema(op)
    args = schema.arguments
    if not args or str(args[0].type) not in ("Tensor", "List[Tensor]"):
        return
    first = [x] if str(args[0].type) == "Tensor" else [[x, y]]
    choices = [first]
    for a in args[1:]:
        if a.has_default_value() and a.kwarg_only:
            choices.append([_DEFAULT])
            continue
        values = _values(a, x, y, sharded_dim)
        if values is None:
            if a.has_default_value():
                values = [_DEFAULT]
            else:
                return
        choices.append(values)
    for combo in itertools.islice(itertools.product(*choices), limit):
        positional, keywords = [], {}
        for a, v in zip(args, combo):
            if v is _DEFAULT:
                continue
            if a.kwarg_only:
                keywords[a.name] = v
            else:
                positional.append(v)
        yield tuple(positional), keywords


class _Default:
    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


def swap_tensors(obj: Any, swap: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor (inside lists and tuples too) replaced by ``swap(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return swap(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(swap_tensors(o, swap) for o in obj)
    if isinstance(obj, dict):
        return {k: swap_tensors(v, swap) for k, v in obj.items()}
    return obj
