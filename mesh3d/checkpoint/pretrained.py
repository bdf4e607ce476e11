"""``load_pretrained``: plain safetensors weights (e.g. a Hugging Face folder) into any parallelized model.

Each rank reads only the box of each tensor that its own parameters and buffers hold (FSDP/HSDP
shards, tensor-parallel slices, DDP/replicated copies, a whole tensor in a plain process), at the
byte offsets the safetensors headers give, straight into the model's storage. A slice that cannot
land in place (another dtype, an accelerator tensor, a non-contiguous shard) goes through one
reused host buffer, so the extra memory is at most the largest such slice. Every check that needs
no tensor data (names, shapes, dtypes, files, key_map) runs first and fails on every rank alike.

Usage::

    info = checkpoint.load_pretrained("llama-hf/", model, dtype=torch.float32)
    info.loaded, info.tied, info.missing, info.unexpected, info.bytes_read
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from mesh3d.checkpoint.chunks import Box, local_box, local_data, row_major_runs
from mesh3d.checkpoint.comm import raise_if_any_failed
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.st_format import DTYPES, ITEMSIZE, TORCH_TO_ST
from mesh3d.checkpoint.weight_source import KeyMap, SourceTensor, WeightSource, map_keys, open_source

__all__ = ["load_pretrained", "PretrainedInfo"]

#: Wrapper segments torch modules insert into ``named_parameters`` names but not into state-dict keys.
_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclass
class PretrainedInfo:
    """What :func:`load_pretrained` did (identical on every rank, except ``bytes_read``/``read_buffer_bytes``).

    Usage: ``info = checkpoint.load_pretrained(src, model, strict=False); print(info.missing, info.unexpected)``

    ``loaded``: model names read from the files. ``tied``: model name -> the tied name it was
    filled through (shared storage). ``missing``: model names the files lack (left as they were;
    only with ``strict=False``). ``unexpected``: file keys (after ``key_map``) the model has no
    tensor for. ``ignored``: file keys ``key_map`` dropped or that name a non-persistent buffer.
    ``cast``: model name -> "BF16->F32" for each tensor converted. ``bytes_read``: file bytes this
    rank read. ``read_buffer_bytes``: the host buffer this rank used for slices that could not land
    in place (its extra memory).
    """

    source: str
    files: list[str]
    loaded: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    cast: dict[str, str] = field(default_factory=dict)
    bytes_read: int = 0
    read_buffer_bytes: int = 0


@dataclass
class _Plan:
    reads: dict[str, str]          # model name -> file key, one per storage
    checks: dict[str, str]         # tied model name -> file key: read and compared with what its tie loaded
    info: PretrainedInfo


def _listing(names: list[str]) -> str:
    return f"{names[:10]}{f' and {len(names) - 10} more' if len(names) > 10 else ''}"


def _tie_groups(model: nn.Module, names: set[str]) -> dict[str, list[str]]:
    """State-dict name -> every state-dict name of the parameter it is (itself first when untied)."""
    by_param: dict[int, list[str]] = defaultdict(list)
    for raw, param in model.named_parameters(remove_duplicate=False):
        name = raw if raw in names else ".".join(p for p in raw.split(".") if p not in _WRAPPER_SEGMENTS)
        if name in names and name not in by_param[id(param)]:
            by_param[id(param)].append(name)
    return {n: group for group in by_param.values() for n in group}


def _dtype_problem(name: str, st: SourceTensor, target: torch.Tensor, dtype: torch.dtype | None) -> str | None:
    have, want = DTYPES[st.dtype], target.dtype
    if have == want:
        return None
    if dtype is None:
        return f"{name}: file {st.dtype}, model {TORCH_TO_ST.get(want, want)} (pass dtype={want} to cast)"
    if not have.is_floating_point or want != dtype:
        return (f"{name}: file {st.dtype}, model {TORCH_TO_ST.get(want, want)}, dtype={dtype} (dtype casts "
                "floating-point file tensors to dtype, which must be the model tensor's dtype)")
    return None


def _plan(source: WeightSource, model_sd: dict[str, torch.Tensor], model: nn.Module, key_map: KeyMap,
          dtype: torch.dtype | None, strict: bool) -> _Plan:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"dtype={dtype!r} must be a floating-point torch.dtype (e.g. torch.bfloat16) or None")
    info = PretrainedInfo(source.path, list(source.files))
    by_model_name, info.ignored = map_keys(source.tensors, key_map)
    non_persistent = {n for n, _ in model.named_buffers()} - set(model_sd)
    info.ignored = sorted(info.ignored + [by_model_name[n] for n in by_model_name if n in non_persistent])
    info.unexpected = sorted(n for n in by_model_name if n not in model_sd and n not in non_persistent)
    ties = _tie_groups(model, set(model_sd))
    reads: dict[str, str] = {}
    checks: dict[str, str] = {}
    for name in model_sd:
        present = [n for n in ties.get(name, [name]) if n in by_model_name]
        if not present:
            info.missing.append(name)
        elif name == present[0]:
            reads[name] = by_model_name[name]
        elif name in present:
            checks[name] = by_model_name[name]
        else:
            info.tied[name] = present[0]
    info.missing.sort()
    if strict and (info.missing or info.unexpected):
        found = ([f"the model's {_listing(info.missing)} are not in the files"] if info.missing else []) + \
                ([f"the files' {_listing(info.unexpected)} are not in the model"] if info.unexpected else [])
        raise CheckpointError(f"keys do not match (strict=True): {'; '.join(found)} (rename with key_map=, e.g. "
                              "checkpoint.key_prefix(strip='model.'), or pass strict=False to load the intersection)")
    shapes, dtypes, meta = [], [], []
    for name, key in {**reads, **checks}.items():
        st, target = source.tensors[key], model_sd[name]
        if tuple(target.shape) != st.shape:
            shapes.append(f"{name}: file {list(st.shape)}" + (f" (as {key!r})" if key != name else "")
                          + f", model {list(target.shape)}")
        problem = _dtype_problem(name, st, target, dtype)
        if problem:
            dtypes.append(problem)
        elif DTYPES[st.dtype] != target.dtype:
            info.cast[name] = f"{st.dtype}->{TORCH_TO_ST[target.dtype]}"
        if local_data(target).is_meta:
            meta.append(name)
    if shapes:
        raise CheckpointError(f"{len(shapes)} tensors have the wrong shape: {_listing(shapes)} (build the model with "
                              "the configuration the weights were saved with)")
    if dtypes:
        raise CheckpointError(f"{len(dtypes)} tensors have another dtype: {_listing(dtypes)}")
    if meta:
        raise CheckpointError(f"{_listing(meta)} are on the meta device: materialize the model first "
                              "(mesh3d.parallelize does, or model.to_empty(device=...))")
    info.loaded = sorted(reads)
    return _Plan(reads, checks, info)


class _SliceReader:
    """Reads boxes of plain safetensors tensors with ``os.preadv``; one reusable host buffer for the rest."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._buffer: torch.Tensor | None = None
        self.bytes_read = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def open(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A contiguous host tensor in the shared buffer (grown as needed, overwritten by the next call)."""
        nbytes = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
        if self._buffer is None or self._buffer.numel() < nbytes or (pinned and not self._buffer.is_pinned()):
            self._buffer = None  # free the smaller one first
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return self._buffer[: int(torch.Size(shape).numel()) * dtype.itemsize].view(dtype).view(shape)

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def read(self, key: str, st: SourceTensor, box: Box, out: torch.Tensor) -> None:
        """Fill ``out`` (CPU, contiguous, ``box.shape``, the file's dtype) with box ``box`` of tensor ``st``."""
        itemsize = ITEMSIZE[st.dtype]
        flat = memoryview((out.reshape(-1) if out.dim() else out.reshape(1)).view(torch.uint8).numpy())
        fd, at = self.open(st.file), 0
        for start, count in row_major_runs(Box((0,) * len(st.shape), st.shape), box):
            n, offset = count * itemsize, st.begin + start * itemsize
            while n:  # preadv may return less than asked (signals, >2 GiB)
                got = os.preadv(fd, [flat[at : at + n]], offset)
                if got <= 0:
                    raise CheckpointError(f"{st.file}: short read for tensor {key!r} (file truncated while loading?)")
                at, offset, n = at + got, offset + got, n - got
        self.bytes_read += at


def _fill(name: str, key: str, st: SourceTensor, target: torch.Tensor, reader: _SliceReader, compare: bool) -> None:
    """Read this rank's box of ``key`` into ``target``'s local storage (or compare with it, for a tie)."""
    box = local_box(name, target)
    if box.numel == 0:
        return
    local = local_data(target).detach()
    file_dtype = DTYPES[st.dtype]
    if not compare and local.device.type == "cpu" and local.is_contiguous() and local.dtype == file_dtype:
        reader.read(key, st, box, local)  # straight into the parameter: no copy, no extra memory
        return
    host = reader.buffer(box.shape, file_dtype, pinned=local.device.type == "cuda")
    reader.read(key, st, box, host)
    if not compare:
        local.copy_(host)  # casts when the dtypes differ, exactly as load_state_dict's copy_ does
    elif not torch.equal(host.to(device=local.device, dtype=local.dtype), local):
        raise CheckpointError(f"the files hold different values for {name!r} and the tensor it is tied to "
                              "(the model shares one storage between them); load with key_map dropping one")


def load_pretrained(src: str | os.PathLike, model: nn.Module, *, key_map: KeyMap = None,
                    dtype: torch.dtype | None = None, strict: bool = True) -> PretrainedInfo:
    """Load plain safetensors weights into ``model``, parallelized or not; all ranks call it.

    Usage: ``info = checkpoint.load_pretrained("llama-hf/", model, key_map=checkpoint.key_prefix(strip="model."))``

    ``src``: a ``.safetensors`` file, or a folder with ``model.safetensors.index.json`` and its
    shards, or with one ``.safetensors`` file (as ``save_pretrained`` writes). Each rank reads only
    the slices its parameters and buffers own; the peak extra memory is one reused read buffer, at
    most the largest owned slice (``info.read_buffer_bytes``; 0 when every slice lands in place). ``key_map`` renames
    file keys to the model's state-dict names: a dict (unlisted keys keep their name), a function
    (return None to skip a key) or :func:`key_prefix`. ``dtype=None`` requires the file's dtypes to
    be the model's; ``dtype=torch.float32`` casts floating-point file tensors to float32 (the model's
    tensors must then be float32; likewise for bfloat16). Tied parameters (one storage under two
    names) are filled from whichever name the files hold; if they hold both, both must be equal.
    File keys naming a non-persistent buffer are ignored. ``strict=True`` fails on missing or
    unexpected keys; ``strict=False`` loads the intersection and lists the rest in the returned
    :class:`PretrainedInfo`. Wrong shapes and dtypes always fail. Every such check runs before any
    data is read and raises the same :class:`CheckpointError` on every rank.
    """
    error, plan, model_sd = None, None, {}
    try:
        model_sd = get_model_state_dict(model)
        source = open_source(src)
        plan = _plan(source, model_sd, model, key_map, dtype, strict)
        for key in {**plan.reads, **plan.checks}.values():  # every file opens before anything is read
            os.close(os.open(source.tensors[key].file, os.O_RDONLY))
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    where = os.path.abspath(os.fspath(src))
    raise_if_any_failed(error, f"loading pretrained weights from {where}", "Nothing was read or modified")
    reader = _SliceReader()
    try:
        for name, key in plan.reads.items():
            _fill(name, key, source.tensors[key], model_sd[name], reader, compare=False)
        for name, key in plan.checks.items():
            _fill(name, key, source.tensors[key], model_sd[name], reader, compare=True)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        reader.close()
    raise_if_any_failed(error, f"loading pretrained weights from {where}", "The model may be partly overwritten")
    plan.info.bytes_read, plan.info.read_buffer_bytes = reader.bytes_read, reader.buffer_bytes
    return plan.info
