"""What an outside hunt of domain tensors found (issue 64), against one process in fp64, on 2 uneven slabs with a
one-row shard (1, 7) and on 3 with an empty one (4, 0, 5):

- a plain buffer written twice with domain values (a rollout's ``buf[t] = x``; the classic FNO's ``out_ft`` with two
  corner writes): the second write put this rank's shard into the whole slice, torch's broadcast error on most ranks
  and, where a shard has one row, a silent broadcast (wrong values, no error); values and input gradients now;
- a write through a boolean mask laid out like the tensor (``h[h > 1] = 1.0``, ``h[torch.isnan(h)] = 0``): a
  RecursionError before; now each rank writes its own elements, gradients included; a tensor of values through the
  mask, or a domain mask into a plain tensor, is refused by name on every rank;
- ``torch.inference_mode()``: every op on a wrapper crashed ("Inference tensors do not track version counter").
"""

from __future__ import annotations

import torch

from domain_cases import max_err, refusals

D64 = torch.float64


def _rollout(t):
    buf = torch.zeros(3, *t.shape, dtype=D64)
    buf[0] = t
    buf[1] = t * 2
    buf[2] = buf[1] + t.sin()
    return buf.sum(0)


def _fno(t):
    ft = torch.fft.rfft2(t)
    out_ft = torch.zeros(ft.shape, dtype=ft.dtype)
    out_ft[:, :, :2, :2] = ft[:, :, :2, :2] * 2
    out_ft[:, :, -2:, :2] = ft[:, :, -2:, :2] * 3
    return torch.fft.irfft2(out_ft, s=t.shape[-2:])


def _clip(t):
    h = t * 1.5
    h[h > 1.0] = 1.0
    h[torch.isnan(h)] = 0.0
    return h * t


def _body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes))
    try:
        x = torch.randn(2, 2, sum(sizes), 6, dtype=D64, generator=torch.Generator().manual_seed(5))
        errs = {}
        for name, f in (("rollout", _rollout), ("fno out_ft", _fno), ("mask write", _clip)):
            ref = x.clone().requires_grad_()
            want = f(ref)
            (want ** 2).sum().backward()
            xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
            got = f(xs)
            (got ** 2).sum().backward()
            errs[name] = max(max_err(got.full_tensor().to_local(), want),
                             max_err(xs.grad.full_tensor().to_local(), ref.grad))
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1, dtype=D64), torch.nn.GroupNorm(1, 3, dtype=D64),
                                  torch.nn.ReLU(inplace=True))
        with torch.inference_mode():
            y = net(domain.shard(x, dim=2, sizes=sizes))
            y.add_(1)
            want = net(x).add_(1)
        errs["inference_mode"] = max_err(y.full_tensor().to_local(), want)
        xs = domain.shard(x, dim=2, sizes=sizes)
        return errs, refusals({"values through a mask": lambda: xs.clone().__setitem__(xs > 0, xs * 2),
                               "domain mask into a plain tensor": lambda: x.clone().__setitem__(xs > 0, 1.0)})
    finally:
        DistributedManager.shutdown()


def test_the_hunts_writes_and_inference_mode_equal_one_process(ranks):
    for sizes in ((1, 7), (4, 0, 5)):
        results = ranks.run(len(sizes), _body, sizes, timeout=120)
        for rank, (errs, refused) in enumerate(results):
            assert all(err < 1e-12 for err in errs.values()), (sizes, rank, errs)
            assert refused == results[0][1], (sizes, rank, refused)  # every rank, the same words
            assert "torch.where(mask, values, x)" in refused["values through a mask"], refused
            assert "laid out like the tensor written" in refused["domain mask into a plain tensor"], refused
