"""``F.unfold`` (im2col) and ``F.fold`` (col2im) on domain tensors against one process, fp64 (``mesh3d.domain.ops
.unfold``): an image sharded along its height unfolds into columns sharded along their positions (whole rows of
patches), with padding, strides, dilation and rectangular kernels; sharded along its channels, into columns sharded
along their patch values; and those columns fold back, overlapping patches summed across ranks. Values and the input's
gradient on slabs of 2 and 3 uneven ranks (an empty shard, a shard of one row); what has no exact sharded answer (an
image sharded along its width, columns cut inside a row of patches, blocks) is refused by name. Then a model written
with them (a convolution as unfold and a matmul, a learned col2im) trains three SGD steps equal to one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import assert_equal_or_refused, case_error, trained_alike

TOL = 1e-10
H, W = 9, 7
D64 = torch.float64


def _cases(shard, shard_dim) -> dict:
    """name -> run(x, sharded): the op on ``x`` (2, 3, H, W), sharded first by ``shard`` (or ``shard_dim``)."""
    def on(fn, how=None):
        return lambda x, sharded: fn((how or shard)(x) if sharded else x)

    def cols_cut_in_a_row(x, sharded):  # the columns themselves sharded inside a row of 7 patches (at 31 or 20)
        cols = F.unfold(x, 3, padding=1)
        return F.fold(shard_dim(cols, 2, "cut") if sharded else cols, (H, W), 3, padding=1)

    return {
        "unfold_3x3_pad": on(lambda x: F.unfold(x, 3, padding=1)),
        "unfold_2x2_stride": on(lambda x: F.unfold(x, 2, stride=2)),
        "unfold_dilated": on(lambda x: F.unfold(x, 3, dilation=2, padding=2)),
        "unfold_rect": on(lambda x: F.unfold(x, (3, 2), padding=(1, 0), stride=(2, 1))),
        "unfold_1x1": on(lambda x: F.unfold(x, 1) * 2),
        "unfold_unbatched": lambda x, sharded: F.unfold(shard_dim(x[0], 1) if sharded else x[0], 3, padding=1),
        "unfold_channels": on(lambda x: F.unfold(x, 3, padding=1), lambda x: shard_dim(x, 1)),
        "unfold_batch": on(lambda x: F.unfold(x, (2, 3), stride=(1, 2)), lambda x: shard_dim(x, 0)),
        "fold_of_unfold": on(lambda x: F.fold(F.unfold(x, 3, padding=1), (H, W), 3, padding=1)),
        "fold_strided": on(lambda x: F.fold(F.unfold(x, 2, stride=2) * 3, (H, W), 2, stride=2)),
        "fold_dilated_rect": on(lambda x: F.fold(F.unfold(x, (3, 2), dilation=(2, 1), padding=(2, 1), stride=(1, 2)),
                                                 (H, W), (3, 2), dilation=(2, 1), padding=(2, 1), stride=(1, 2))),
        "fold_unbatched": lambda x, sharded: F.fold(F.unfold(shard_dim(x[0], 1) if sharded else x[0], 3, padding=1),
                                                    (H, W), 3, padding=1),
        "unfold_width": on(lambda x: F.unfold(x, 3, padding=1), lambda x: shard_dim(x, 3)),
        "fold_cut_in_a_row": cols_cut_in_a_row,
    }


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    x0 = torch.randn(2, 3, H, W, dtype=D64, generator=torch.Generator().manual_seed(4))
    world = layout["world"]

    def shard(t: torch.Tensor) -> torch.Tensor:
        return domain.shard(t, dim=2, sizes=layout["sizes"])

    def shard_dim(t: torch.Tensor, dim: int, sizes: str = "uneven") -> torch.Tensor:
        n = t.shape[dim]
        if sizes == "cut":
            return domain.shard(t, dim=dim, sizes=(31, n - 31) if world == 2 else (20, 0, n - 20))
        # uneven, the last rank holding the most
        return domain.shard(t, dim=dim, sizes=tuple(n // world + (1 if r >= world - n % world else 0) for r in range(world)))

    errors = {name: case_error(fn, x0, i) for i, (name, fn) in enumerate(_cases(shard, shard_dim).items())}
    DistributedManager.shutdown()
    return errors


LAYOUTS = {
    "slabs 2 (8, 1)": {"world": 2, "grid": 2, "sizes": (8, 1)},
    "slabs 3 (4, 0, 5)": {"world": 3, "grid": 3, "sizes": (4, 0, 5)},
}
_WIDTH, _CUT = "torch.nn.functional.unfold", "torch.nn.functional.fold"


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_unfold_and_fold_equal_one_process_or_are_refused_by_name(ranks, layout):
    spec = LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        assert_equal_or_refused(errors, {"unfold_width": _WIDTH, "fold_cut_in_a_row": _CUT}, TOL)


def _blocks_body() -> list[str]:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    xs = domain.shard(torch.randn(2, 3, H, W, dtype=D64), dims=(2, 3), sizes=((5, 4), (3, 4)))
    refusals = []
    for op in (lambda: F.unfold(xs, 3, padding=1), lambda: F.fold(xs.flatten(2), (H, W), 1)):
        with pytest.raises(NotImplementedError) as refused:
            op()
        refusals.append(str(refused.value))
    DistributedManager.shutdown()
    return refusals


def test_on_blocks_the_patches_of_two_sharded_dims_interleave_so_unfold_and_fold_are_refused_by_name(ranks):
    for unfold, fold in ranks.run(4, _blocks_body):
        assert unfold.startswith("torch.nn.functional.unfold") and "block" in unfold, unfold
        assert fold.startswith("torch.nn.functional.fold"), fold


class PatchNet(torch.nn.Module):
    """A 3x3 convolution written as unfold and a matmul (its positions viewed back into rows), tanh, then a learned
    col2im: each 2x2 patch's values mixed by a linear map and folded back, overlapping (stride 1) patches summed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Parameter(torch.randn(4, 2 * 9, dtype=D64) * 0.3)
        self.mix = torch.nn.Linear(4 * 4, 4 * 4, dtype=D64)

    def forward(self, x):
        n, _, h, w = x.shape
        y = torch.tanh((self.conv @ F.unfold(x, 3, padding=1)).view(n, 4, h, w))
        cols = F.unfold(y, 2, padding=1)
        return F.fold(self.mix(cols.transpose(1, 2)).transpose(1, 2), (h, w), 2, padding=1)


def _train_body(layout: dict, steps: int) -> float:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    torch.manual_seed(0)

    def loss(model, step, sharded):
        field = torch.randn(2, 2, H, W, dtype=D64, generator=torch.Generator().manual_seed(step))
        x = domain.shard(field, dim=2, sizes=layout["sizes"]) if sharded else field
        return (model(x) - x[:, :1]).square().mean()

    worst = trained_alike(PatchNet(), loss, steps, 0.05)
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_model_built_of_unfold_and_fold_trains_equal_to_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    assert max(ranks.run(spec["world"], _train_body, spec, 3)) < TOL
