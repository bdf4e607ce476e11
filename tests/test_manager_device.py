"""Where ranks compute: ``initialize(backend=..., device=...)`` and ``group_settings.choose_transport``.

The CUDA cases run with CUDA faked available (the device objects need no GPU to exist); the refusals run on real
ranks, where every rank must raise before any collective."""

from __future__ import annotations

import pytest
import torch

from mesh3d.group_settings import choose_transport
from mesh3d.staged_gloo import STAGED


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch sees ``n`` CUDA devices; returns the list ``STAGED.register`` calls land in."""
    registered: list[int] = []
    monkeypatch.setattr(STAGED, "register", lambda: registered.append(1) or "gloo_staged")

    def see(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return registered
    return see


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_gloo_on_cuda_is_the_staged_transport_on_local_rank_modulo_gpus(gpus, local_rank):
    registered = gpus(1)
    assert choose_transport("gloo", "cuda", local_rank, existing=None) == ("gloo_staged", torch.device("cuda", 0))
    gpus(2)
    assert choose_transport("gloo", torch.device("cuda"), local_rank, None) == ("gloo_staged",
                                                                               torch.device("cuda", local_rank % 2))
    assert len(registered) == 2  # the backend is registered with torch when it is chosen


def test_nccl_and_cpu_choices_are_unchanged_and_stage_nothing(gpus):
    registered = gpus(4)
    assert choose_transport(None, None, 5, None) == ("nccl", torch.device("cuda", 1))
    assert choose_transport("nccl", "cuda", 2, None) == ("nccl", torch.device("cuda", 2))
    assert choose_transport(None, "cpu", 2, None) == ("gloo", torch.device("cpu"))
    assert choose_transport("gloo", None, 2, None) == ("gloo", torch.device("cpu"))
    assert choose_transport(None, "cuda", 0, existing="nccl") == ("nccl", torch.device("cuda", 0))
    assert registered == []
    gpus(0)
    assert choose_transport(None, None, 3, None) == ("gloo", torch.device("cpu"))
    assert choose_transport("gloo_staged", None, 3, None) == ("gloo_staged", torch.device("cpu"))


def test_an_existing_gloo_group_gets_staged_mesh_groups_for_cuda_ranks(gpus):
    registered = gpus(1)
    assert choose_transport(None, "cuda", 2, existing="gloo") == ("gloo_staged", torch.device("cuda", 0))
    assert choose_transport("nccl", None, 2, existing="gloo") == ("gloo", torch.device("cpu"))  # as before: kept
    assert choose_transport(None, None, 2, existing="gloo_staged") == ("gloo_staged", torch.device("cuda", 0))
    assert len(registered) == 2


def test_bad_devices_and_combinations_are_refused_naming_the_choices(gpus):
    gpus(1)
    for device in ("gpu", "cuda:1", torch.device("cuda", 0), "mps"):
        with pytest.raises(ValueError, match=r"use one of \('cpu', 'cuda'\)"):
            choose_transport("gloo", device, 0, None)
    with pytest.raises(ValueError, match="device='cpu' cannot go with it; use backend='gloo'"):
        choose_transport("nccl", "cpu", 0, None)
    with pytest.raises(ValueError, match="device='cpu' cannot go with it"):
        choose_transport(None, "cpu", 0, existing="nccl")
    gpus(0)
    for backend in ("gloo", None, "gloo_staged"):
        with pytest.raises(ValueError, match="device='cuda' needs CUDA.*use device='cpu'"):
            choose_transport(backend, "cuda", 0, None)
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_transport("nccl", None, 0, None)


def _device_requests():
    """On every rank of the pool (CPU, no CUDA): refusals before any collective, then the staged mesh on CPU."""
    import torch.distributed as dist

    from mesh3d import DistributedManager

    messages = []
    for kwargs in ({"backend": "gloo", "device": "cuda"}, {"device": "gpu"}):
        try:
            DistributedManager.initialize(1, 2, 1, **kwargs)
        except ValueError as err:
            messages.append(str(err))
    assert not DistributedManager.is_initialized()
    dm = DistributedManager.initialize(1, 2, 1, backend="gloo_staged")
    staged = (dm.backend, dm.device.type, type(dm.group("domain")).__name__, dist.get_backend(dm.group("world")))
    DistributedManager.shutdown()
    dm = DistributedManager.initialize(1, 2, 1, device="cpu")
    plain = (dm.backend, dm.device.type, type(dm.group("domain")).__name__)
    return messages, staged, plain


def test_initialize_refuses_cuda_without_it_on_every_rank_and_builds_staged_meshes(ranks):
    for messages, staged, plain in ranks.run(2, _device_requests):
        assert len(messages) == 2
        assert "device='cuda' needs CUDA" in messages[0] and "torch.cuda.is_available() is False" in messages[0]
        assert "device='gpu'" in messages[1] and "('cpu', 'cuda')" in messages[1]
        assert staged == ("gloo_staged", "cpu", "StagedGlooGroup", "gloo_staged")
        assert plain == ("gloo", "cpu", "ProcessGroup")

