"""einsum on lat x lon blocks that contracts one grid letter and keeps the other (issue 67): a Legendre transform sums
the latitudes and keeps the longitude modes. Each contracted grid line sums its partial products and splits a new
letter of the output among its ranks (pencils, as Makani's distributed SHT), against one process in fp64: values,
the input's and the weight's gradients, forward, inverse and the round trip, on uneven 2x2 blocks with an empty one.
An einsum whose output has no letter to split is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from domain_cases import domain_sum, max_err

D64 = torch.float64
B, C, H, W, L = 2, 3, 7, 6, 5  # (B, C, lat, m) fields; L degrees
BLOCKS = {"(2, 4) x (4, 3)": ((2, 4), (4, 3)), "(5, 1) x (7, 0)": ((5, 1), (7, 0))}  # modes x latitudes


def _pencils_body(sizes) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(B, C, W, H, dtype=D64, generator=g)     # (..., m, lat): longitude modes before latitudes
    fwd0, inv0 = torch.randn(W, L, H, dtype=D64, generator=g), torch.randn(W, L, H, dtype=D64, generator=g)
    errors = {}
    calls = {
        "forward": lambda x, f, i: torch.einsum("...mk,mlk->...lm", x, f),
        "inverse of the transposed": lambda x, f, i: torch.einsum("...lm,mlk->...mk", x.transpose(-1, -2)[..., :L, :], i),
        "round trip": lambda x, f, i: torch.einsum("...lm,mlk->...mk", torch.einsum("...mk,mlk->...lm", x, f) * 0.5, i),
    }
    for name, call in calls.items():
        x, f, i = (t.clone().requires_grad_() for t in (x0, fwd0, inv0))
        want = call(x, f, i)
        weights = torch.randn(want.shape, dtype=D64, generator=torch.Generator().manual_seed(len(name)))
        (want * weights).sum().backward()
        grads = [t.grad for t in (x, f, i)]
        x.grad = f.grad = i.grad = None
        ys = call(domain.shard(x, dims=(2, 3), sizes=sizes), f, i)
        whole = ys.full_tensor().to_local()
        (whole * weights).sum().backward()
        got = [domain_sum(x.grad)] + [domain_sum(t.grad) if t.grad is not None else torch.zeros_like(t) for t in (f, i)]
        errors[name] = max(max_err(whole, want.detach()), *(max_err(a, b if b is not None else torch.zeros_like(a))
                                                            for a, b in zip(got, grads)))
    try:
        torch.einsum("mk->m", domain.shard(x0[0, 0], dims=(0, 1), sizes=sizes))
        errors["no letter to split"] = "ran"
    except NotImplementedError as err:
        errors["no letter to split"] = str(err)
    DistributedManager.shutdown()
    return errors


@pytest.mark.parametrize("layout", list(BLOCKS))
def test_an_einsum_contracting_one_grid_letter_moves_to_pencils_equal_to_one_process(ranks, layout):
    for errors in ranks.run(4, _pencils_body, BLOCKS[layout]):
        refusal = errors.pop("no letter to split")
        assert "has no other letter to split over that grid line" in refusal, refusal
        assert max(errors.values()) < 1e-12, errors
