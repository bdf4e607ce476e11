"""Distributed checkpoints: sharded plain safetensors plus a JSON index, reshardable onto any mesh.

Usage::

    from mesh3d import checkpoint
    checkpoint.save("ckpt/step-100", model, optimizer, step=100, extra={"seed": 0})   # all ranks
    handle = checkpoint.async_save("ckpt/step-200", model, optimizer, step=200)       # returns once staged
    info = checkpoint.load("ckpt/step-100", model, optimizer)                        # any mesh shape
    checkpoint.coalesce("ckpt/step-100", "export/hf")                                # one process
    checkpoint.load_pretrained("llama-hf/", model)                                   # HF safetensors, any mesh
    checkpoint.save_nodes("ckpt/nodes", {"embed": rows}, part)                        # node-partitioned tensors

Nothing is pickled: tensors are in safetensors files, everything else is JSON.
"""

from mesh3d.checkpoint.background import AsyncSave, async_save
from mesh3d.checkpoint.coalesce import coalesce
from mesh3d.checkpoint.errors import CheckpointError, CheckpointFormatError
from mesh3d.checkpoint.index import read_index, validate_index
from mesh3d.checkpoint.inspect import describe, verify
from mesh3d.checkpoint.load import LoadInfo, load
from mesh3d.checkpoint.manager import CheckpointManager
from mesh3d.checkpoint.nodes import load_nodes, save_nodes
from mesh3d.checkpoint.pretrained import PretrainedInfo, load_pretrained
from mesh3d.checkpoint.save import save
from mesh3d.checkpoint.weight_source import key_prefix
from mesh3d.checkpoint.inflight import IN_FLIGHT
from mesh3d.manager import DistributedManager

# NOTE: a background save still being written finishes (commit included) before the groups go, at shutdown()
# and at exit; its failure, if nobody has seen it, is raised by shutdown() on every rank.
DistributedManager.on_teardown(IN_FLIGHT.wait)
# ... and the group it committed over goes with the manager's groups: the next manager's saves commit over a group
# with that manager's timeout.
DistributedManager.on_shutdown(IN_FLIGHT.release_group)

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointManager",
    "LoadInfo",
    "PretrainedInfo",
    "async_save",
    "coalesce",
    "describe",
    "key_prefix",
    "load",
    "load_nodes",
    "load_pretrained",
    "read_index",
    "save",
    "save_nodes",
    "validate_index",
    "verify",
]
