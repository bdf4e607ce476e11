"""A model built on the meta device leaves no meta tensors behind for the next model built on the CPU.

torch-harmonics 0.9.3 keeps its Legendre polynomials in lru caches keyed by sizes, not by device, so a
``RealSHT`` built under ``torch.device("meta")`` leaves meta tensors there, and the next one of the same sizes built
on the CPU gets meta buffers (its forward fails: "Tensor on device cpu is not on the expected device meta!"). That
made a forecast test fail when an earlier test in the same worker had built the weather model on meta. mesh3d builds
users' models on meta in ``mesh3d plan``/``check``/``explain`` and Lightning's meta init (``built_on_meta``). Single
process, no ranks."""

from __future__ import annotations

import pytest
import torch

from mesh3d.meta_builds import built_on_meta, forget_device_blind_caches

torch_harmonics = pytest.importorskip("torch_harmonics")  # NOTE: the zoo extra; present wherever the suite runs


def _buffer_devices() -> set[str]:
    return {b.device.type for b in torch_harmonics.RealSHT(17, 32, lmax=9).buffers()}


def test_a_model_built_on_meta_leaves_the_next_cpu_model_on_the_cpu():
    with torch.device("meta"):  # the hazard itself, as torch-harmonics has it: a plain meta build poisons its cache
        torch_harmonics.RealSHT(17, 32, lmax=9)
    assert _buffer_devices() == {"meta"}
    forget_device_blind_caches()
    assert _buffer_devices() == {"cpu"}
    with built_on_meta():
        on_meta = torch_harmonics.RealSHT(17, 32, lmax=9)
    assert {b.device.type for b in on_meta.buffers()} == {"meta"}
    assert _buffer_devices() == {"cpu"}
    x = torch.randn(2, 17, 32)
    assert torch.allclose(torch_harmonics.InverseRealSHT(17, 32, lmax=9)(torch_harmonics.RealSHT(17, 32, lmax=9)(x)),
                          torch_harmonics.InverseRealSHT(17, 32, lmax=9)(torch_harmonics.RealSHT(17, 32, lmax=9)(x)))


def test_mesh3d_plan_builds_on_meta_without_poisoning_the_process(tmp_path):
    """``mesh3d plan`` of the weather example's SFNO (torch-harmonics inside), then the same model on the CPU."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "examples"))
    try:
        import weather
    finally:
        sys.path.remove(str(root / "examples"))
    from mesh3d.planner.job import _meta_model

    _meta_model(weather.SFNO)
    net = weather.SFNO().double()
    assert {b.device.type for b in net.buffers()} == {"cpu"}
    assert net(torch.randn(1, 4, weather.NLAT, weather.NLON, dtype=torch.float64)).isfinite().all()
