"""The settings domain rules read at call time, as one frozen value: attention mode and its options, overlap.

Usage::

    SETTINGS.value.attention.mode                   # what a rule reads ("auto", "ring", "gather", "ulysses")
    with SETTINGS.replaced(new_value): ...          # what ``domain.attention_mode`` / ``domain.window_overlap`` do
    snapshot = SETTINGS.value                       # what activation checkpointing's recomputation restores

The value is replaced whole, never changed in place, so one read is a consistent snapshot: a recomputed region
runs with the settings its forward saw (``mesh3d.domain.recompute``), and a compiled graph guards on the fields
it read (a change recompiles).

NOTE: a slot on an object rather than a ``contextvars.ContextVar``: Dynamo (torch 2.13) cannot trace
``ContextVar.get`` (a graph break on every rule that reads a setting), while it traces an attribute read and
guards on the value. The ``with`` blocks restore the previous value on exit, as a context variable's token would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch.compiler import is_compiling, is_dynamo_compiling

__all__ = ["ATTENTION_KERNELS", "ATTENTION_MODES", "AttentionSettings", "DomainSettings", "OverlapSettings", "SETTINGS",
           "SettingsSlot", "ValueSlot", "refuse_while_traced", "traced"]

T = TypeVar("T")

ATTENTION_MODES = ("auto", "ring", "gather", "ulysses")
ATTENTION_KERNELS = ("fused", "math")


@dataclass(frozen=True)
class AttentionSettings:
    """How attention on domain tensors runs (``domain.attention_mode`` sets it inside a block).

    ``mode``: one of ``ATTENTION_MODES``; ``head_groups``: the ring goes round once per group of K/V heads
    (smaller blocks in flight); ``kernel``: ``"fused"`` (torch's fused kernel where it applies) or ``"math"``;
    ``balance``: the zigzag layout for causal rings; ``ring_min_tokens``: ``auto`` picks the ring from this many
    keys on.

    NOTE: 2048 and 8 come from ``scripts/bench_attention.py`` on the 2-core CPU (docs/benchmarks.md): 8 head
    groups hold 0.86x the peak memory of 4 at D=4 for the same compute time (more, smaller messages).
    """

    mode: str = "auto"
    head_groups: int = 8
    kernel: str = "fused"
    balance: bool = True
    ring_min_tokens: int = 2048


@dataclass(frozen=True)
class OverlapSettings:
    """Whether window ops that declare ``overlap`` use it, on slabs (``enabled``) and on blocks (``blocks``).

    NOTE: on by default on slabs (the benchmark shows a gain on CPU) and off on blocks: there each conv makes
    one more exchange round per grid dim and runs strip kernels, and on the 2-core CPU the step took 1.08-1.32x
    longer (docs/benchmarks.md). Turn it on where messages are slow next to the compute.
    """

    enabled: bool = True
    blocks: bool = False


def _wrapper_from_environment() -> bool:
    """Whether this process makes wrapper domain tensors (``DomainSettings.wrapper``), from ``MESH3D_DOMAIN_WRAPPER``."""
    value = os.environ.get("MESH3D_DOMAIN_WRAPPER", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MESH3D_DOMAIN_WRAPPER must be 1 (wrapper domain tensors, the default) or 0 (the storage "
                         f"subclass), not {value!r}")
    return value == "1"


@dataclass(frozen=True)
class DomainSettings:
    """Every setting the domain rules read, one frozen value.

    ``wrapper``: domain tensors are made as the wrapper subclass of ``mesh3d.domain.core.wrapped`` (the default since
    issue 64), or as the storage subclass of ``mesh3d.domain.core.tensor`` where ``MESH3D_DOMAIN_WRAPPER=0`` is set for
    the process (private: the way back while the wrapper is new, e.g. on a GPU it has not been measured on).
    """

    attention: AttentionSettings = AttentionSettings()
    overlap: OverlapSettings = OverlapSettings()
    wrapper: bool = field(default_factory=_wrapper_from_environment)


class ValueSlot(Generic[T]):
    """Holds one value in force (``value``, a ``kind``); ``replaced(v)`` puts ``v`` there inside a ``with`` block.

    Usage: ``slot = ValueSlot(DomainSettings(), "settings"); with slot.replaced(other): ...``
    """

    def __init__(self, value: T, what: str) -> None:
        self.value, self._kind, self._what = value, type(value), what

    @contextlib.contextmanager
    def replaced(self, value: T) -> Iterator[T]:
        if not isinstance(value, self._kind):
            raise TypeError(f"{self._what} must be a {self._kind.__name__}, not {type(value).__name__}")
        before, self.value = self.value, value
        try:
            yield value
        finally:
            self.value = before


class SettingsSlot(ValueSlot[DomainSettings]):
    """Holds the settings in force (``value``); ``replaced(v)`` puts ``v`` there inside a ``with`` block.

    Usage: ``with SETTINGS.replaced(replace(SETTINGS.value, overlap=OverlapSettings(False))): ...``
    """

    def __init__(self) -> None:
        super().__init__(DomainSettings(), "settings")


#: The settings of this process (one per process: every rank of a domain group must run with the same).
SETTINGS = SettingsSlot()


def traced() -> bool:
    """Whether a rule runs while ``torch.compile`` traces it: it then emits the compiled forms of its exchanges and
    attention (custom ops, read when the graph runs) instead of running them now.

    Usage: ``if traced(): return exchange_rows(...)``

    NOTE: two tracers run the rules: Dynamo, which inlines a storage domain tensor's ``__torch_function__``, and,
    for wrapper tensors (issue 64's switch), Dynamo's fake run of each recorded op and AOTAutograd's trace of the
    graph, which call the rules on fake shards outside Dynamo (``is_dynamo_compiling()`` is False
    there, ``is_compiling()`` True).
    """
    return is_dynamo_compiling() or (SETTINGS.value.wrapper and is_compiling())


def refuse_while_traced(op: str, why: str) -> None:
    """Raise ``NotImplementedError`` while ``torch.compile`` traces a rule that must read its tensors' values (a
    mask's new layout, counts whose length depends on the ids): Dynamo then breaks the graph before the op and runs
    it eagerly.

    Usage: ``refuse_while_traced("torch.bincount", "its length depends on the ids")``
    """
    if traced():
        raise NotImplementedError(f"{op} under torch.compile: {why}, which a trace on fake shards cannot read; "
                                  "Dynamo runs it eagerly (a graph break)")
