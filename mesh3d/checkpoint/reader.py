"""Read any box of a saved tensor, touching only the checksum blocks that hold it.

For each saved chunk that overlaps the wanted box, the overlap is a set of contiguous
runs in the chunk's row-major bytes (one run when it spans the trailing dims). Only the
256 KiB checksum blocks under those runs are read (``os.preadv`` at offsets taken from
the index, checked against the file's own safetensors header) and each block's checksum
is verified before use, with the algorithm the index names (xxh3_64; crc32 in version-1
checkpoints). ``stats`` records bytes read vs bytes needed (read amplification).

Usage::

    reader = ShardReader(path, index)
    reader.read_into("layer.weight", Box((5, 0), (5, 6)), out)   # fills out (a CPU tensor)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mesh3d.checkpoint.chunks import Box, overlap, row_major_runs, row_major_strides
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.index import checksum_scheme
from mesh3d.checkpoint.st_format import DTYPES, ITEMSIZE, read_header

__all__ = ["ShardReader"]


class ShardReader:
    """Reads saved chunks of one checkpoint with byte-range precision and checksum checks."""

    def __init__(self, path: str, index: dict[str, Any], verify_headers: bool = True) -> None:
        self.path, self.index = path, index
        self.algorithm, self.block, self._sums = checksum_scheme(index)
        self.verify_headers = verify_headers
        self._fds: dict[str, int] = {}
        self.stats = {"bytes_read": 0, "bytes_needed": 0, "header_bytes": 0}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd(self, rel: str, tensor: str) -> int:
        if rel in self._fds:
            return self._fds[rel]
        file = os.path.join(self.path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"missing shard file {file} (needed for tensor {tensor!r})")
        want, have = self.index["files"][rel]["bytes"], os.path.getsize(file)
        if have != want:
            raise CheckpointError(f"shard file {file} has {have} bytes but the index records {want} "
                                  f"(truncated or replaced; needed for tensor {tensor!r})")
        if self.verify_headers:
            self._check_header(file, rel)
        self._fds[rel] = os.open(file, os.O_RDONLY)
        return self._fds[rel]

    def _check_header(self, file: str, rel: str) -> None:
        """The file's own safetensors header must describe exactly the chunks the index puts there."""
        entries, start = read_header(file)
        self.stats["header_bytes"] += start
        for name, tensor in self.index["tensors"].items():
            for chunk in tensor["chunks"]:
                if chunk["file"] != rel:
                    continue
                got = entries.get(chunk["key"])
                want = (tensor["dtype"], tuple(chunk["shape"]), tuple(chunk["data_offsets"]))
                if got != want:
                    raise CheckpointError(f"shard file {file}: header entry {chunk['key']!r} is {got}, but the index "
                                          f"says {want} for tensor {name!r} (corrupt header or mismatched files)")

    def open_needed(self, boxes: dict[str, Box]) -> None:
        """Open (size- and header-check) every file holding a chunk that overlaps one of ``boxes``.

        Run before any tensor data is read, so a missing, truncated or mismatched file fails the
        load while the model is still untouched, even for in-place loads.
        """
        for name, box in boxes.items():
            for chunk in self.index["tensors"][name]["chunks"]:
                ov = overlap(Box(tuple(chunk["offsets"]), tuple(chunk["shape"])), box)
                if ov is not None and ov.numel:
                    self._fd(chunk["file"], name)

    def read_into(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Fill ``out`` (CPU, contiguous, shape ``box.shape``) with the saved values of ``name`` in ``box``."""
        entry = self.index["tensors"][name]
        dtype = DTYPES[entry["dtype"]]
        for chunk in entry["chunks"]:
            cbox = Box(tuple(chunk["offsets"]), tuple(chunk["shape"]))
            ov = overlap(cbox, box)
            if ov is None or ov.numel == 0:
                continue
            dst = out[tuple(slice(o - b, o - b + n) for o, b, n in zip(ov.offsets, box.offsets, ov.shape))]
            if dst.is_contiguous() and len(row_major_runs(cbox, ov)) == 1:
                self._read_direct(name, chunk, cbox, ov, dst, ITEMSIZE[entry["dtype"]])
                continue
            dst.copy_(self._read_overlap(name, chunk, cbox, ov, dtype, ITEMSIZE[entry["dtype"]]))

    def _read_direct(self, name: str, chunk: dict[str, Any], cbox: Box, ov: Box, dst: torch.Tensor,
                     itemsize: int) -> None:
        """One contiguous run into a contiguous destination: scatter-read straight into it.

        The covering checksum blocks are read with one ``preadv`` whose iovecs are a small
        head buffer, the destination itself and a small tail buffer, so the common dim-0
        case costs no intermediate copy; each block's checksum is streamed across the pieces.
        """
        (start, count), = row_major_runs(cbox, ov)
        span0, span1 = start * itemsize, (start + count) * itemsize
        block, chunk_bytes = self.block, cbox.numel * itemsize
        lo, hi = span0 // block * block, min(-(-span1 // block) * block, chunk_bytes)
        head = torch.empty(span0 - lo, dtype=torch.uint8)
        tail = torch.empty(hi - span1, dtype=torch.uint8)
        body = dst.view(-1).view(torch.uint8) if dst.dim() else dst.reshape(1).view(torch.uint8)
        pieces = [(lo, memoryview(head.numpy())), (span0, memoryview(body.numpy())), (span1, memoryview(tail.numpy()))]
        fd = self._fd(chunk["file"], name)
        got = os.preadv(fd, [p for _, p in pieces if len(p)], chunk["data_offsets"][0] + lo)
        if got != hi - lo:
            raise CheckpointError(f"shard file {os.path.join(self.path, chunk['file'])}: short read for tensor "
                                  f"{name!r} (file truncated while reading?)")
        algorithm, sums = self.algorithm, chunk[self._sums]
        for b in range(lo // block, -(-hi // block)):
            b0, b1, hasher = b * block, min((b + 1) * block, chunk_bytes), algorithm.stream()
            for at, piece in pieces:
                s0, s1 = max(b0, at), min(b1, at + len(piece))
                if s0 < s1:
                    hasher.update(piece[s0 - at : s1 - at])
            if algorithm.finish(hasher) != sums[b]:
                raise CheckpointError(
                    f"checksum mismatch in {os.path.join(self.path, chunk['file'])} for tensor {name!r} "
                    f"(chunk at offsets {chunk['offsets']}, bytes {chunk['data_offsets'][0] + b0}..): the data is corrupt")
        self.stats["bytes_read"] += hi - lo
        self.stats["bytes_needed"] += span1 - span0

    def _read_overlap(self, name: str, chunk: dict[str, Any], cbox: Box, ov: Box, dtype: torch.dtype,
                      itemsize: int) -> torch.Tensor:
        runs = [(s * itemsize, n * itemsize) for s, n in row_major_runs(cbox, ov)]
        span0, span1 = runs[0][0], runs[-1][0] + runs[-1][1]
        chunk_bytes, block = cbox.numel * itemsize, self.block
        wanted = sorted({b for s, n in runs for b in range(s // block, (s + n - 1) // block + 1)})
        groups: list[list[int]] = []
        for b in wanted:
            if groups and groups[-1][-1] == b - 1:
                groups[-1].append(b)
            else:
                groups.append([b])
        fd = self._fd(chunk["file"], name)
        base = chunk["data_offsets"][0]
        checksum, sums = self.algorithm.of, chunk[self._sums]
        buffers: list[tuple[int, torch.Tensor]] = []
        for group in groups:
            lo, hi = group[0] * block, min((group[-1] + 1) * block, chunk_bytes)
            buf = torch.empty(hi - lo, dtype=torch.uint8)  # not bytearray: that would memset first
            got = os.preadv(fd, [buf.numpy()], base + lo)
            if got != len(buf):
                raise CheckpointError(f"shard file {os.path.join(self.path, chunk['file'])}: short read for tensor "
                                      f"{name!r} (file truncated while reading?)")
            view = memoryview(buf.numpy())
            for b in group:
                s = b * block - lo
                if checksum(view[s : s + block]) != sums[b]:
                    raise CheckpointError(
                        f"checksum mismatch in {os.path.join(self.path, chunk['file'])} for tensor {name!r} "
                        f"(chunk at offsets {chunk['offsets']}, bytes {base + b * block}..): the data is corrupt")
            self.stats["bytes_read"] += len(buf)
            buffers.append((lo, buf))
        self.stats["bytes_needed"] += ov.numel * itemsize
        strides = row_major_strides(cbox.shape)
        if len(buffers) == 1:
            lo, buf = buffers[0]
            flat = buf[span0 - lo : span1 - lo]
        else:
            flat = torch.empty(span1 - span0, dtype=torch.uint8)
            for s, n in runs:
                lo, buf = next((lo, b) for lo, b in buffers if lo <= s < lo + len(b))
                flat[s - span0 : s - span0 + n] = buf[s - lo : s - lo + n]
        values = flat.view(dtype) if flat.numel() else torch.empty(0, dtype=dtype)
        return values.as_strided(ov.shape, strides) if cbox.shape else values.reshape(())
