"""Divergence detection: every domain exchange checks that its peers ran the same domain ops.

Usage::

    from mesh3d.domain.comm.divergence import DomainDivergenceError
    try:
        loss = model(xs).mean()        # a model that branches on this rank's data or local sizes
    except DomainDivergenceError as err:
        print(err)                     # the first op that differs on each rank, and its source line

Sizes are global (``x.shape`` is the whole tensor's), so branches on sizes take the same path on every
rank. What they cannot cover can still differ per rank: a branch on this rank's data
(``if xs.to_local().max() > 0:``) or local sizes (``xs.local_shape``), or random numbers drawn on some
ranks only, can send each domain rank down a different path. Each rank keeps
a journal of the layout-changing domain ops it ran (op name, the result's sharded dim and global
length, the user's source line) as a running fingerprint. Every exchange (halo, gather, redistribute
and the domain reductions, forward and backward) first swaps a fixed-size header with each peer it
exchanges with: the fingerprint and the bytes each side will send. Equal headers: the data follow.
Different ones: both sides swap their journals, tell every other domain rank to stop (so nobody waits
on them), and raise ``DomainDivergenceError`` naming, per rank, the first op that differs. Messages
never go out with a size the receiver does not expect (gloo aborts the process on that). No collective
is added: the headers are point-to-point messages to the exchange's own peers, one small round before
its data. Data of at most ``INLINE_BYTES`` (a reduction's partial sums, a small halo) on the CPU travels inside the
header itself: that exchange is one round, not two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import sys
from collections import deque
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch
import xxhash

__all__ = ["DomainDivergenceError", "JOURNAL", "OpJournal", "describe_divergence"]

#: Header words: MAGIC, kind, fingerprint, bytes the sender sends the receiver, bytes it expects from it; then room
#: for ``INLINE_BYTES`` of data (``inlined``). Every header is this long, so one receive reads any kind of header.
MAGIC = 0x6D657368  # "mesh"
_FIELDS = 5
#: Data up to this size rides in its header. NOTE: a gloo message of 40 bytes and one of 8 KB take the same time
#: between two local ranks (300-570 us a round on a 2-core VM, 2026-12-07), and a domain reduction's partial sums,
#: a norm's statistics, a small halo fit: each such exchange took a header round, then a data round.
INLINE_BYTES = 4096
HEADER_WORDS = _FIELDS + INLINE_BYTES // 8
_ZEROS = torch.zeros(HEADER_WORDS - _FIELDS, dtype=torch.int64)  # read only: the empty tail of every header
KIND_DATA, KIND_ABORT, KIND_ERROR, KIND_LOST = 1, 2, 3, 4  # KIND_LOST: the fingerprint word holds the lost rank

# Frames in these folders are torch's or mesh3d's own: the "user's source line" is the first frame outside them.
# NOTE: mesh3d's folder from this module's dotted name (``mesh3d.domain.comm.divergence``: three folders up), so the
# module may move without this line changing.
_INTERNAL_DIRS = (os.path.dirname(torch.__file__ or "") + os.sep,
                  str(Path(__file__).resolve().parents[__name__.count(".") - 1]) + os.sep)


class DomainDivergenceError(RuntimeError):
    """Domain ranks ran different domain ops (a branch on per-rank data or local sizes, or a one-rank random draw).

    Usage: ``except DomainDivergenceError as err: print(err)``
    """


@dataclass
class OpJournal:
    """The layout-relevant domain ops this process ran, as a running fingerprint and the latest entries.

    Usage: ``JOURNAL.record("torch.nn.functional.pad", (2, 33))``; exchanges send ``fingerprint``.

    The fingerprint covers every op since the process started (not only since the last exchange),
    so a rank that skipped an exchange because it had nothing to send still agrees with its peers,
    and a divergence that no exchange saw yet (nothing moved) is caught at the next one, forward or
    backward. Ops that keep the layout and move nothing (element-wise ones) are not recorded: running
    them on some ranks only cannot desynchronize the exchanges.
    """

    entries: deque = field(default_factory=lambda: deque(maxlen=256))
    fingerprint: int = 0
    count: int = 0
    _internal: dict[int, tuple[CodeType, bool]] = field(default_factory=dict)

    def record(self, op: str, summary: tuple) -> None:
        """Add one op (its name and rank-independent summary) and where the user's code called it."""
        self.count += 1
        self.entries.append((self.count, op, summary, self._caller()))
        # NOTE: not hash(): Python salts str hashes per process, and every rank is its own process.
        self.fingerprint = xxhash.xxh3_64_intdigest(f"{self.fingerprint}|{op}|{summary}".encode()) & 0x7FFFFFFFFFFFFFFF

    def reset(self) -> None:
        """Start over (a new mesh: ``DistributedManager.shutdown`` calls it)."""
        self.entries.clear()
        self.fingerprint = self.count = 0

    def _caller(self) -> str:
        """``file:line in function`` of the nearest frame outside torch and mesh3d (cached per code object)."""
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            # NOTE: by id, the code kept beside it: a code object hashes its constants, and the frames Dynamo makes to
            # resume after a graph break hold slices among them (unhashable on Python 3.11)
            hit = self._internal.get(id(code))
            if hit is None or hit[0] is not code:
                hit = self._internal[id(code)] = code, code.co_filename.startswith(_INTERNAL_DIRS) or \
                    code.co_filename.startswith("<")
            if not hit[1]:
                return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
            frame = frame.f_back
        return "unknown"


#: The process's journal (one domain group per process; ``DistributedManager.shutdown`` resets it).
JOURNAL = OpJournal()


def header(kind: int, fingerprint: int = 0, to_peer: int = 0, from_peer: int = 0,
           data: torch.Tensor | None = None) -> torch.Tensor:
    """A header of ``HEADER_WORDS`` words; ``data`` (``inlined``) rides in its tail."""
    h = torch.cat((torch.tensor([MAGIC, kind, fingerprint, to_peer, from_peer], dtype=torch.int64), _ZEROS))
    if data is not None:
        h.view(torch.uint8)[8 * _FIELDS:8 * _FIELDS + to_peer].copy_(
            data.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8))
    return h


def fields(h: torch.Tensor) -> list[int]:
    """A received header's five words (magic, kind, fingerprint, bytes it sends, bytes it expects)."""
    return h[:_FIELDS].tolist()


def inlined(buf: torch.Tensor) -> bool:
    """Whether ``buf`` (a message's data, either side) travels inside its header: the sender and the receiver
    decide alike, from the bytes their matched headers agree on."""
    nbytes = buf.numel() * buf.element_size()
    return 0 < nbytes <= INLINE_BYTES and buf.device.type == "cpu"


def read_inlined(h: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy the data that rode in header ``h`` into ``buf`` (any layout)."""
    nbytes = buf.numel() * buf.element_size()
    raw = h.view(torch.uint8)[8 * _FIELDS:8 * _FIELDS + nbytes].clone()  # NOTE: offset 0, aligned for any dtype
    buf.copy_(raw.view(buf.dtype).view(buf.shape))


def encode_journal(entries) -> bytes:
    return json.dumps([[n, op, list(summary), where] for n, op, summary, where in entries]).encode()


def _format(entry) -> str:
    if entry is None:
        return "no further op"
    n, op, summary, where = entry
    dim, length = summary
    layout = f"result sharded on dim {dim}, global length {length}" if dim is not None else "replicated result"
    return f"op #{n}, {op} ({layout}) at {where}"


def describe_divergence(me: int, peer: int, mine, theirs: list | None, detail: str) -> str:
    """The error message: where the two ranks' journals first differ, the likely cause and what to do."""
    lines = [f"domain ranks {me} and {peer} ran different domain ops ({detail})."]
    if theirs is not None:
        # NOTE: the peer's entries came through JSON, which turns tuples inside a summary into lists
        a = {n: (n, op, _tupled(summary), where) for n, op, summary, where in mine}
        b = {n: (n, op, _tupled(summary), where) for n, op, summary, where in theirs}
        common = sorted(set(a) | set(b))
        at = next((n for n in common if a.get(n, (None,) * 3)[1:3] != b.get(n, (None,) * 3)[1:3]), None)
        if at is not None:
            lines += ["  the first op that differs:",
                      f"    rank {me}: {_format(a.get(at))}",
                      f"    rank {peer}: {_format(b.get(at))}"]
    lines.append(LIKELY_CAUSE)
    return "\n".join(lines)


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, (list, tuple)) else value


def peer_stopped_error(me: int, peer: int, kind: int, same: bool, told: str, who: str = "") -> DomainDivergenceError:
    """Domain rank ``peer`` stopped (its notice of ``kind`` came instead of its header); ``told``: its error, if known;
    ``who``: the peer as a global rank with its mesh coordinates (``rank 3 (batch 1, domain 1, model 0)``).

    NOTE: the global rank too: on a mesh with a batch axis, domain rank 1 is another process on every batch row.
    A peer that failed with an error of its own (``same`` journals) did not diverge: the divergence hint is left out.
    """
    said = f" with {told}" if told else ""
    what = (f"failed in a domain op{said} and stopped" if kind == KIND_ERROR else
            "stopped (the domain ranks ran different domain ops, or a peer of it failed or was lost)")
    name = f"domain rank {peer} ({who})" if who else f"domain rank {peer}"
    hint = "" if kind == KIND_ERROR and same else "\n" + LIKELY_CAUSE
    return DomainDivergenceError(
        f"{name} {what} while this rank (domain rank {me}) waited for it; the two ran "
        f"{'the same' if same else 'different'} domain ops so far. Rank {peer}'s error says what failed. Latest here:\n"
        + recent_ops() + hint)


def recent_ops(count: int = 3) -> str:
    """This rank's last layout-changing domain ops and their source lines (for error messages)."""
    entries = list(JOURNAL.entries)[-count:]
    if not entries:
        return "  (no layout-changing domain op recorded on this rank)"
    return "\n".join(f"  this rank's {_format(e)}" for e in entries)


LIKELY_CAUSE = (
    "Likely cause: the ranks branched on something that differs per rank: this rank's data (a branch on "
    "xs.to_local()), its local sizes (xs.local_shape, xs.to_local().shape), or random numbers drawn on some ranks "
    "only. Sizes read from x.shape are global and the same on every rank; branch on global values (a reduction such "
    "as x.amax() is replicated), and seed with DistributedManager.manual_seed so every domain rank draws alike. "
    "See docs/domain.md, 'When ranks take different paths'."
)
