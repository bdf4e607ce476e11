"""Safetensors weights from outside mesh3d: one file, or a Hugging Face folder (index + shards), and key renaming.

Only headers are read here: every tensor's file, dtype, shape and absolute byte range, checked
against the file sizes and (for a sharded folder) against ``model.safetensors.index.json``'s
``weight_map``. The names can then be mapped onto the model's names with a ``key_map``.

Usage::

    source = open_source("llama-hf/")          # a folder, a model.safetensors, or any .safetensors file
    source.tensors["model.norm.weight"]        # SourceTensor(file, dtype, shape, begin, end)
    renamed, dropped = map_keys(source.tensors, key_prefix(strip="model."))
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

from mesh3d.checkpoint.errors import CheckpointError, CheckpointFormatError
from mesh3d.checkpoint.index import INDEX_NAME
from mesh3d.checkpoint.st_format import read_header

__all__ = ["SourceTensor", "WeightSource", "KeyMap", "open_source", "key_prefix", "map_keys",
           "HF_INDEX_NAME", "HF_SINGLE_NAME"]

HF_INDEX_NAME = "model.safetensors.index.json"
HF_SINGLE_NAME = "model.safetensors"

#: file key -> model key (keys not listed keep their name), or a function of the file key returning the
#: model key or None (the file tensor is deliberately not loaded), or None (names are used as they are).
KeyMap = Union[Mapping[str, str], Callable[[str], Union[str, None]], None]


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes are: absolute file path, safetensors dtype, shape, absolute [begin, end)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class WeightSource:
    """The safetensors files of one set of weights and every tensor in them (headers only)."""

    path: str
    files: list[str]
    tensors: dict[str, SourceTensor]


def _folder_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a folder, and the HF index's weight_map (key -> file) where there is one."""
    if os.path.isfile(os.path.join(path, INDEX_NAME)) and not os.path.isfile(os.path.join(path, HF_INDEX_NAME)):
        raise CheckpointError(f"{path} is a mesh3d checkpoint (it has {INDEX_NAME}); load it with checkpoint.load")
    index_file = os.path.join(path, HF_INDEX_NAME)
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in weight_map.items()):
                raise TypeError("weight_map must map tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointFormatError(f"{index_file} is not a safetensors index ({type(err).__name__}: {err})") from None
        files = []
        for rel in sorted(set(weight_map.values())):
            file = os.path.normpath(os.path.join(path, rel))
            if os.path.dirname(file) != os.path.normpath(path) or not rel.endswith(".safetensors"):
                raise CheckpointFormatError(f"{index_file} names {rel!r}, which is not a .safetensors file in {path}")
            if not os.path.isfile(file):
                raise CheckpointError(f"{index_file} lists {rel}, which does not exist in {path}")
            files.append(file)
        return files, {k: os.path.normpath(os.path.join(path, v)) for k, v in weight_map.items()}
    single = os.path.join(path, HF_SINGLE_NAME)
    if os.path.isfile(single):
        return [single], None
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if len(found) == 1:
        return found, None
    raise CheckpointError(f"{path} has no {HF_INDEX_NAME} and no {HF_SINGLE_NAME}, and {len(found)} .safetensors "
                          f"files {[os.path.basename(f) for f in found][:5]} (expected exactly one, or an index)")


def open_source(src: str | os.PathLike) -> WeightSource:
    """Parse the headers of every file of ``src`` (a safetensors file or a folder); no tensor data is read.

    Usage: ``source = open_source("llama-hf/"); source.tensors["lm_head.weight"].shape``
    """
    path = os.path.abspath(os.fspath(src))
    weight_map = None
    if os.path.isdir(path):
        files, weight_map = _folder_files(path)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise CheckpointError(f"{path} does not exist (expected a .safetensors file or a folder holding "
                              f"{HF_SINGLE_NAME} or {HF_INDEX_NAME} and its shards)")
    tensors: dict[str, SourceTensor] = {}
    for file in files:
        entries, _ = read_header(file)
        for name, (dtype, shape, (begin, end)) in entries.items():
            if name in tensors:
                raise CheckpointFormatError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = SourceTensor(file, dtype, shape, begin, end)
    if weight_map is not None:
        wrong = sorted(k for k in set(weight_map) | set(tensors)
                       if k not in tensors or k not in weight_map or tensors[k].file != weight_map[k])
        if wrong:
            raise CheckpointFormatError(f"{path}/{HF_INDEX_NAME} does not match its shards' headers for "
                                        f"{len(wrong)} tensors, e.g. {wrong[:5]} (missing from a shard, or in another one)")
    return WeightSource(path, files, tensors)


def key_prefix(strip: str = "", add: str = "") -> Callable[[str], str]:
    """A ``key_map`` that removes ``strip`` from the front of each file key that has it, then prepends ``add``.

    Usage: ``checkpoint.load_pretrained("llama-hf/", model, key_map=checkpoint.key_prefix(strip="model."))``
    """

    def rename(key: str) -> str:
        return add + (key[len(strip):] if strip and key.startswith(strip) else key)

    rename.__qualname__ = f"key_prefix(strip={strip!r}, add={add!r})"
    return rename


def map_keys(file_keys: list[str] | dict[str, object], key_map: KeyMap) -> tuple[dict[str, str], list[str]]:
    """``{model key: file key}`` after ``key_map``, and the file keys it dropped (mapped to None).

    Raises :class:`CheckpointError` when two file keys map to the same model key.
    """
    renamed: dict[str, str] = {}
    dropped: list[str] = []
    for key in file_keys:
        if key_map is None:
            new = key
        elif isinstance(key_map, Mapping):
            new = key_map.get(key, key)
        elif callable(key_map):
            new = key_map(key)
        else:
            raise CheckpointError(f"key_map must be a dict, a function or None, not {type(key_map).__name__}")
        if new is None:
            dropped.append(key)
            continue
        if not isinstance(new, str):
            raise CheckpointError(f"key_map({key!r}) returned {new!r}; it must return a str (or None to skip the key)")
        if new in renamed:
            raise CheckpointError(f"key_map maps both {renamed[new]!r} and {key!r} to {new!r}")
        renamed[new] = key
    return renamed, sorted(dropped)
