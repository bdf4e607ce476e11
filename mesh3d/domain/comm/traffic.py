"""What domain exchanges send: counted (``count_traffic``) or, in a dry run, only reported (``dry_run``).

Usage::

    with count_traffic() as traffic:
        loss.backward()
    traffic.bytes_sent, traffic.messages, traffic.rounds, traffic.exchange_seconds
    with dry_run(lambda comm, outgoing, incoming: seen.append(outgoing)):
        model(xs_on_meta)                       # mesh3d.planner: one rank's ops, no process group

``mesh3d.domain.comm.exchange`` posts the messages and reports each exchange here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ExchangeObserver", "TrafficCounter", "count_traffic", "dry_run", "dry_run_observer"]


class TrafficCounter:
    """Bytes this process sent through ``gather_rows`` (forward and backward) while it was active.

    Usage: ``with count_traffic() as traffic: step(); traffic.bytes_sent``
    """

    _active: list[TrafficCounter] = []  # counters open now (nested ones all count)

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.messages = 0
        self.rounds = 0  # batched exchanges (one batch_isend_irecv each) this rank took part in
        self.exchange_seconds = 0.0  # wall time inside exchanges (posting and waiting): what overlap could hide

    @classmethod
    def record(cls, nbytes: int, messages: int, seconds: float) -> None:
        for counter in cls._active:
            counter.bytes_sent += nbytes
            counter.messages += messages
            counter.rounds += 1
            counter.exchange_seconds += seconds


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficCounter]:
    """Count the bytes sent by domain exchanges inside the block.

    Usage: ``with count_traffic() as traffic: loss.backward(); print(traffic.bytes_sent)``
    """
    counter = TrafficCounter()
    TrafficCounter._active.append(counter)
    try:
        yield counter
    finally:
        TrafficCounter._active.remove(counter)


#: ``observer(comm, outgoing, incoming)``: the exchange's ``DomainComm`` and its (peer, buffer) pairs.
ExchangeObserver = Callable[[Any, list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]], Any]


class _DryRun:
    """Whether exchanges send (the default) or only report what they would send (``dry_run``)."""

    def __init__(self) -> None:
        self.observer: ExchangeObserver | None = None


_DRY_RUN = _DryRun()


@contextlib.contextmanager
def dry_run(observer: ExchangeObserver) -> Iterator[None]:
    """Inside the block no exchange sends anything: each calls ``observer(comm, outgoing, incoming)`` with the
    (peer, buffer) pairs it would post, counts its bytes in ``count_traffic`` as a real one would, and leaves the
    incoming buffers as they are. For ``mesh3d.planner``, which runs one rank's ops on meta tensors with a
    ``DomainComm`` of the real size and no process group.

    Usage: ``with dry_run(lambda comm, out, inc: seen.append(len(out))): model(xs_on_meta)``
    """
    previous, _DRY_RUN.observer = _DRY_RUN.observer, observer
    try:
        yield
    finally:
        _DRY_RUN.observer = previous


def dry_run_observer() -> ExchangeObserver | None:
    """The observer of the ``dry_run`` in force, or None when exchanges send for real.

    Usage: ``if dry_run_observer() is not None: ...  # only shapes and sizes matter``
    """
    return _DRY_RUN.observer
