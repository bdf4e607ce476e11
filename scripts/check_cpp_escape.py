"""What a compiled extension sees of a domain tensor: the storage subclass against the wrapper tensor (issue 64).

Usage::

    python scripts/check_cpp_escape.py        # builds a two-function extension (about 30 s), prints what each kind gave

The extension calls ``at::sum(x)`` and loops over ``x.data_ptr<double>()``: C++ that mesh3d's Python rules never
see. On 2 domain ranks, the storage subclass hands it this rank's shard (the shard's sum, silently); the wrapper
tensor (the default kind; ``MESH3D_DOMAIN_WRAPPER=0`` gives the storage subclass) has no storage and sends
``at::sum`` to its ``__torch_dispatch__`` floor, which refuses it by name, and the ``data_ptr`` loop raises.
``tests/test_domain_cpp_extension.py`` builds the same source and checks the wrapper tensor (about 20 s).
"""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
at::Tensor sum_all(at::Tensor x) { return at::sum(x); }
at::Tensor relu(at::Tensor x) { return at::relu(x); }
double loop(at::Tensor x) {
  auto p = x.data_ptr<double>();
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
  return s;
}
"""
#: What ``SOURCE`` defines (``relu``: an element-wise op, which the floor answers; tests/test_domain_cpp_extension.py)
FUNCTIONS = ["sum_all", "relu", "loop"]


def _rank(rank: int, world: int, port: int) -> None:
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import wrapper_tensors

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    ext = load_inline("mesh3d_escape_probe", cpp_sources=SOURCE, functions=FUNCTIONS)
    DistributedManager.initialize(batch=1, domain=world)
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    for kind, on in (("storage", False), ("wrapper", True)):
        with wrapper_tensors(on):
            xs = domain.shard(x, dim=0)
            for name, call in (("at::sum", ext.sum_all), ("data_ptr loop", ext.loop)):
                try:
                    answer = f"{float(call(xs))} (one process: {float(x.sum())})"
                except (NotImplementedError, RuntimeError) as err:
                    answer = f"{type(err).__name__}: {str(err).splitlines()[0][:110]}"
                print(f"rank {rank} {kind:7s} {name:13s} {answer}", flush=True)
    DistributedManager().shutdown()


def main() -> None:
    start = time.perf_counter()
    load_inline("mesh3d_escape_probe", cpp_sources=SOURCE, functions=FUNCTIONS)  # built once, then cached
    print(f"extension built in {time.perf_counter() - start:.1f} s")
    mp.spawn(_rank, args=(2, 29517), nprocs=2)


if __name__ == "__main__":
    main()
