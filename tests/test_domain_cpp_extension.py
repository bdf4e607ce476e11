"""A compiled C++ extension (``torch.utils.cpp_extension.load_inline``) handed domain tensors, the C++ that mesh3d's
Python rules never see (issue 64): its ``at::sum`` is refused by name, never the shard's sum; its ``at::relu``, an
element-wise op, gives the one-process answer and gradient; its loop over ``data_ptr`` raises (a wrapper tensor has
no storage of its own: torch's error, "not allocated"). 2 ranks uneven, 3 with an empty shard, fp64. The build takes
about 20 s on 2 cores (``scripts/check_cpp_escape.py``, whose source this is, shows the storage subclass giving the
shard's sum, silently)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from check_cpp_escape import FUNCTIONS, SOURCE  # noqa: E402  (the script's extension: at::sum, at::relu, a data_ptr loop)


def _load(build: str):
    from torch.utils.cpp_extension import load_inline

    # NOTE: -O0: the build is header parsing and codegen for three one-line functions; optimizing them costs seconds
    return load_inline("mesh3d_cpp_escape_test", cpp_sources=SOURCE, functions=FUNCTIONS, build_directory=build,
                       extra_cflags=["-O0", "-g0"])


def _body(build, sizes):
    from mesh3d import DistributedManager, domain

    ext = _load(build)  # NOTE: built by the test's process: here the module is only loaded
    DistributedManager.initialize(batch=1, domain=len(sizes))
    try:
        x = torch.linspace(-3, 3, 2 * sum(sizes) * 3, dtype=torch.float64).reshape(2, sum(sizes), 3)
        xs = domain.shard(x, dim=1, sizes=sizes).requires_grad_()
        found = {}
        for name, call in (("at::sum", ext.sum_all), ("data_ptr loop", ext.loop)):
            try:
                found[name] = f"ran: {call(xs)!r}"
            except (NotImplementedError, RuntimeError) as err:
                found[name] = f"{type(err).__name__}: {err}"
        y = ext.relu(xs)
        ref = x.clone().requires_grad_()
        (torch.relu(ref) * ref).sum().backward()
        (y * xs).sum().backward()
        found["relu"] = (type(y).__name__, tuple(y.shape), float((y.full_tensor().to_local() - torch.relu(x)).abs().max()),
                         float((xs.grad.full_tensor().to_local() - ref.grad).abs().max()))
        return found
    finally:
        DistributedManager.shutdown()


def test_a_cpp_extension_never_sees_a_shard_as_the_whole_tensor(ranks, tmp_path):
    pytest.importorskip("torch.utils.cpp_extension")
    _load(str(tmp_path))
    for sizes in ((2, 3), (3, 0, 2)):
        for rank, found in enumerate(ranks.run(len(sizes), _body, str(tmp_path), sizes, timeout=180)):
            assert found["at::sum"].startswith("NotImplementedError") and \
                "aten.sum.default reached a domain tensor below mesh3d's rules" in found["at::sum"], (sizes, rank, found)
            # NOTE: C++'s data_ptr never reaches Python: torch's own error, that the (whole tensor's) data is absent
            assert found["data_ptr loop"].startswith("RuntimeError") and \
                "not allocated" in found["data_ptr loop"], (sizes, rank, found)
            kind, shape, err, grad_err = found["relu"]
            assert kind == "WrappedDomainTensor" and shape == (2, sum(sizes), 3), (sizes, rank, found)
            assert err == 0.0 and grad_err < 1e-12, (sizes, rank, found)
