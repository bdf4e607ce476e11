"""Reshard matrix: save on mesh A, load on mesh B, full state (model + AdamW) bitwise equal.

Every configuration in ``ckpt_helpers.CONFIGS`` (1, 2, 4, 8 ranks; FSDP over batch and/or
domain, HSDP, TP, FSDP+TP with _StridedShard, DDP-like replicas, TP-only with implicit
batch replicas; uneven 13/10/6-sized dims incl. empty shards) saves one checkpoint after a
training step; then every configuration loads every checkpoint and compares its gathered
state with the saved reference bitwise (torch.equal, fp64): a load copies bytes, so any
difference is a bug. A plain process without torch.distributed loads them all too.
"""

from __future__ import annotations

import os

import safetensors.torch
import torch

from ckpt_helpers import CONFIGS, Net, build, configs_for, diff, full_state, shutdown, synthetic_steps

WORLDS = (1, 2, 4, 8)


def _save_body(root: str, world: int) -> dict[str, tuple[int, int]]:
    from mesh3d import checkpoint

    written = {}
    for i, config in enumerate(configs_for(world)):
        model, opt = build(config, seed=10 + i * 7 + world)
        synthetic_steps(model, opt, range(world))  # differing step counts per source
        checkpoint.save(os.path.join(root, f"src-{config}"), model, opt, step=world, extra={"config": config})
        ref = full_state(model, opt)
        if torch.distributed.get_rank() == 0:
            safetensors.torch.save_file(ref, os.path.join(root, f"ref-{config}.safetensors"))
        shutdown()
    return written


def _load_body(root: str, world: int) -> dict[str, list[str]]:
    from mesh3d import checkpoint

    failures: dict[str, list[str]] = {}
    for config in configs_for(world):
        model, opt = build(config, seed=999)
        for source in CONFIGS:
            # Alternate the two load modes: all-or-nothing buffers and in-place reads.
            info = checkpoint.load(os.path.join(root, f"src-{source}"), model, opt, in_place=(list(CONFIGS).index(source) + len(config)) % 2 == 0)
            want = safetensors.torch.load_file(os.path.join(root, f"ref-{source}.safetensors"))
            bad = diff(full_state(model, opt), want)
            if info.extra != {"config": source} or info.bytes_read < info.bytes_needed:
                bad.append(f"info {info}")
            if bad:
                failures[f"{source}->{config}"] = bad
        shutdown()
    return failures


def test_reshard_matrix_bitwise(ranks, tmp_path):
    """Every configuration's checkpoint (1, 2, 4, 8 ranks; FSDP, HSDP, TP, DDP, uneven dims, empty shards) loads
    bitwise on every other configuration and in a plain process (model and AdamW state)."""
    root = str(tmp_path)
    for world in WORLDS:
        ranks.run(world, _save_body, root, world, timeout=240)
    for world in WORLDS:
        results = ranks.run(world, _load_body, root, world, timeout=240)
        assert results == [{}] * world, results
    # A laptop: no process group, no DistributedManager, a plain nn.Module and optimizer.
    assert not torch.distributed.is_initialized()
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for source in CONFIGS:
        info = checkpoint_load(os.path.join(root, f"src-{source}"), model, opt)
        want = safetensors.torch.load_file(os.path.join(root, f"ref-{source}.safetensors"))
        assert diff(full_state(model, opt), want) == [], source
        assert info.bytes_read >= info.bytes_needed > 0


def checkpoint_load(path, model, opt):
    from mesh3d import checkpoint

    return checkpoint.load(path, model, opt)
