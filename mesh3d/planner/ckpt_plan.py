"""A checkpoint's files before it is written, and what a load onto another mesh reads, from layouts alone.

``checkpoint.save`` has each rank write the box it holds of every tensor (replicas split its rows, so every
element is written once) into ``model/rNNNNN-of-NNNNN.safetensors`` and ``optimizer/...``; the header is the
one ``st_format.plan_header`` lays out. Here the same boxes come from ``ModelLayout`` and the same
``plan_header`` gives each file's exact size. A load reads, for each target box, the checksum blocks under
its overlap with every saved chunk (``checkpoint.reader``); the same arithmetic gives bytes read and needed.

Usage::

    ckpt = CheckpointLayout(layout, optimizer="adamw")
    ckpt.files(rank)                          # {"model/r00003-of-00008.safetensors": bytes, ...}
    ckpt.read_cost(CheckpointLayout(target_layout, "adamw"), target_rank)   # (needed, read, files opened)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mesh3d.checkpoint.chunks import Box, overlap, replica_part, row_major_runs
from mesh3d.checkpoint.save import DEFAULT_CHECKSUM_BLOCK_BYTES
from mesh3d.checkpoint.st_format import TORCH_TO_ST, plan_header
from mesh3d.planner.layout import ModelLayout, ParamLayout, optimizer_state_keys

__all__ = ["CheckpointLayout", "Entry"]


@dataclass(frozen=True)
class Entry:
    """One tensor of the saved state: its name, role, dtype, global shape and parameter layout (None: a buffer)."""

    name: str
    role: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    param: ParamLayout | None


class CheckpointLayout:
    """Which rank writes which part of every tensor, and the files that makes (see the module docstring)."""

    def __init__(self, layout: ModelLayout, optimizer: str = "adamw",
                 block: int = DEFAULT_CHECKSUM_BLOCK_BYTES) -> None:
        self.layout, self.block = layout, block
        self.world = layout.mesh.world
        entries = [Entry(p.name, "model", p.dtype, p.shape, p) for p in layout.params]
        entries += [Entry(name, "model", dtype, shape, None) for name, shape, dtype, persistent in layout.buffers
                    if persistent]
        for key in optimizer_state_keys(optimizer):
            entries += [Entry(f"optimizer.{p.name}.{key}", "optimizer", p.dtype, p.shape, p)
                        for p in layout.params if p.requires_grad]
        self.entries = entries
        self._parts_of: dict[int, dict[str, dict[str, tuple[str, tuple[int, ...]]]]] = {}

    # ------------------------------------------------------------------ one rank
    def box(self, e: Entry, rank: int) -> Box:
        if e.param is None:
            return Box((0,) * len(e.shape), e.shape)
        return self.layout.box(e.param, rank)

    def replicas(self, e: Entry, rank: int) -> tuple[int, int]:
        """(how many ranks hold this rank's box of ``e``, this rank's place among them)."""
        if e.param is None:
            return self.world, rank
        return self.layout.replica_position(e.param, rank)

    def part(self, e: Entry, rank: int) -> Box | None:
        """What ``rank`` writes of ``e`` (None: nothing), as ``checkpoint.save`` splits replicated boxes."""
        n, i = self.replicas(e, rank)
        part = replica_part(self.box(e, rank), list(range(n)), i)
        return part if part is not None and part.numel else None

    def _parts(self, rank: int) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
        """Per role, what ``rank`` writes: {tensor name: (safetensors dtype, part shape)} (kept: a plan asks again)."""
        known = self._parts_of.get(rank)
        if known is None:
            known = self._parts_of[rank] = {
                role: {e.name: (TORCH_TO_ST[e.dtype], part.shape) for e in self.entries if e.role == role
                       for part in [self.part(e, rank)] if part is not None} for role in ("model", "optimizer")}
        return known

    def files(self, rank: int, label: int | None = None) -> dict[str, int]:
        """The shard files ``rank`` writes and their exact sizes in bytes (``label``: the rank its header names)."""
        out = {}
        for role, parts in self._parts(rank).items():
            if not parts:
                continue
            header, ranges = plan_header(parts, {"format": "pt", "mesh3d_rank": str(rank if label is None else label)})
            out[f"{role}/r{rank:05d}-of-{self.world:05d}.safetensors"] = len(header) + sum(b - a for a, b in ranges.values())
        return out

    # ------------------------------------------------------------------ every rank at once
    def header_names_matter(self, ranks: list[int]) -> bool:
        """Whether the number of digits of the rank named in a header can change a file's size (its JSON crossing
        a 4 KiB boundary) for the files of any of ``ranks``."""
        widest = 10 ** len(str(self.world - 1)) - 1
        return any(list(self.files(r, 0).values()) != list(self.files(r, widest).values()) for r in ranks)

    def signatures(self, digits: bool = False, held: bool = False) -> torch.Tensor:
        """One int64 per rank, equal for ranks whose files hold parts of the same shapes (a hash; O(N) vector ops);
        ``digits``: ranks whose numbers have different lengths differ too; ``held``: the boxes ranks hold (what a
        load reads into) instead of the parts they write."""
        mesh, sharding = self.layout.mesh, self.layout.sharding
        r = torch.arange(self.world, dtype=torch.int64)
        bd, m = r // mesh.model, r % mesh.model
        s, rep = bd % sharding.shard, bd // sharding.shard
        sig = torch.tensor([len(str(x)) for x in range(self.world)] if digits else [0] * self.world, dtype=torch.int64)
        for e in self.entries:
            if e.param is None:
                rows = torch.full_like(r, e.shape[0] if e.shape else 1)
                n, i = torch.full_like(r, self.world), r
            else:
                p = e.param
                if sharding.fsdp:
                    c, n0 = self.layout.chunk(p), self.layout.tp_shape(p)[0]
                    rows = (n0 - s * c).clamp(0, c)
                else:
                    rows = torch.full_like(r, self.layout.tp_shape(p)[0])
                if p.tp_dim is not None:
                    n, i = torch.full_like(r, sharding.replicas), rep
                else:
                    n, i = torch.full_like(r, sharding.replicas * mesh.model), rep * mesh.model + m
            if held:
                part = rows
            else:
                part = rows * (i + 1) // n - rows * i // n if e.shape else (i == 0).long()
            sig = sig * 1000003 + part
        return sig

    def chunk_records(self, rank: int) -> list[dict]:
        """The index's chunk records for what ``rank`` writes (checksums as placeholders of the right form)."""
        out = []
        for e in self.entries:
            part = self.part(e, rank)
            if part is None:
                continue
            nbytes = part.numel * e.dtype.itemsize
            out.append({"checksums": ["0" * 16] * -(-nbytes // self.block), "data_offsets": [4096, 4096 + nbytes],
                        "file": f"{e.role}/r{rank:05d}-of-{self.world:05d}.safetensors", "key": e.name,
                        "offsets": list(part.offsets), "shape": list(part.shape)})
        return out

    # ------------------------------------------------------------------ loading onto another mesh
    def saved_chunks(self, e: Entry, box: Box) -> list[tuple[Box, int]]:
        """The saved chunks of ``e`` that meet ``box``, with the rank that wrote each, in the index's order."""
        if e.param is None:
            held = Box((0,) * len(e.shape), e.shape)
            return _replica_chunks(held, self.world, box, lambda i: i)
        p, mesh, sharding = e.param, self.layout.mesh, self.layout.sharding
        sharded = p.tp_dim is not None
        found = []
        for m in range(mesh.model) if sharded else (0,):
            for s in self._shards_meeting(p, m, box):
                held = self.layout.box(p, s * mesh.model + m)  # the first replica group holds shard s at index s
                if not held.numel or overlap(held, box) is None:
                    continue

                def writer(i: int, s: int = s, m: int = m) -> int:
                    rep, mm = (i, m) if sharded else divmod(i, mesh.model)
                    return (rep * sharding.shard + s) * mesh.model + mm

                found += _replica_chunks(held, sharding.replicas * (1 if sharded else mesh.model), box, writer)
        return sorted(found, key=lambda cw: cw[0].offsets)

    def _shards_meeting(self, p: ParamLayout, m: int, box: Box) -> range:
        """The FSDP shards of model rank ``m``'s block of ``p`` whose rows meet ``box`` (all shards' rows: dim 0)."""
        if not self.layout.sharding.fsdp:
            return range(1)
        c = self.layout.chunk(p)
        base = m * self.layout.tp_shape(p)[0] if p.tp_dim == 0 else 0
        lo, hi = box.offsets[0] - base, box.offsets[0] + box.shape[0] - base
        return range(max(lo // c, 0), max(min(-(-hi // c), self.layout.sharding.shard), 0))

    def read_cost(self, target: CheckpointLayout, rank: int) -> tuple[int, int, int]:
        """(bytes needed, bytes read, files opened) when ``rank`` of ``target`` loads this checkpoint."""
        needed = read = 0
        files: set[tuple[str, int]] = set()
        for e, t in zip(self.entries, target.entries):
            box = target.box(t, rank)
            if not box.numel:
                continue
            item = e.dtype.itemsize
            for chunk, writer in self.saved_chunks(e, box):
                ov = overlap(chunk, box)
                if ov is None or not ov.numel:
                    continue
                files.add((e.role, writer))
                n, r = self._chunk_read(chunk, ov, box, item)
                needed, read = needed + n, read + r
        return needed, read, len(files)

    def _chunk_read(self, chunk: Box, ov: Box, box: Box, item: int) -> tuple[int, int]:
        """``ShardReader.read_into``'s bytes for one overlap: one block-aligned read, or the blocks under each run."""
        runs = row_major_runs(chunk, ov)
        block, chunk_bytes = self.block, chunk.numel * item
        if _contiguous_slice(ov.shape, box.shape) and len(runs) == 1:
            (start, count), = runs
            span0, span1 = start * item, (start + count) * item
            lo, hi = span0 // block * block, min(-(-span1 // block) * block, chunk_bytes)
            return span1 - span0, hi - lo
        wanted = sorted({b for s, k in runs for b in range(s * item // block, ((s + k) * item - 1) // block + 1)})
        read, group_start, prev = 0, None, None
        for b in wanted + [None]:
            if group_start is not None and (b is None or b != prev + 1):
                read += min((prev + 1) * block, chunk_bytes) - group_start * block
                group_start = None
            if b is not None and group_start is None:
                group_start = b
            prev = b
        return ov.numel * item, read


def _contiguous_slice(part: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    """Whether a ``part``-shaped slice of a C-contiguous ``whole``-shaped tensor is contiguous (as torch says)."""
    if 0 in part:
        return True
    dims = [d for d, n in enumerate(part) if n != 1]
    return not dims or all(part[d] == whole[d] for d in range(dims[0] + 1, len(whole)))


def _rows_part(held: Box, n: int, i: int) -> Box | None:
    """``replica_part(held, list(range(n)), i)`` without building the list (n may be the world size)."""
    if not held.shape:
        return held if i == 0 else None
    rows = held.shape[0]
    begin, end = rows * i // n, rows * (i + 1) // n
    if end <= begin or held.numel == 0:
        return None
    return Box((held.offsets[0] + begin, *held.offsets[1:]), (end - begin, *held.shape[1:]))


def _replica_chunks(held: Box, n: int, box: Box, writer: Callable[[int], int]) -> list[tuple[Box, int]]:
    """The parts of ``held`` that its ``n`` replicas write (rows split in replica order) meeting ``box``."""
    if not held.shape:
        return [(held, writer(0))]
    rows = held.shape[0]
    lo = max(box.offsets[0] - held.offsets[0], 0)
    hi = min(box.offsets[0] + box.shape[0] - held.offsets[0], rows)
    if n > rows:  # one row per writing replica: the replica of row j is the last i with rows * i // n <= j
        replicas: list[int] | range = sorted({-(-(j + 1) * n // rows) - 1 for j in range(lo, hi)})
    else:
        replicas = range(max(lo * n // rows - 1, 0), min(-(-hi * n // rows) + 1, n))
    out = []
    for i in replicas:
        part = _rows_part(held, n, i)
        if part is not None and overlap(part, box) is not None:
            out.append((part, writer(i)))
    return out
