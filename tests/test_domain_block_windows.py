"""Windows, patches and turned faces on lat x lon blocks (issue 67): a reshape that splits both block dims (Swin's
window partition, einops' ``(h p1) (w p2)`` patching) runs on slabs, its output meets its shortcut on blocks or tokens
again; ``flip``/``rot90``, a transposed operand, ``stack`` and a ``cat`` of a face turned by ``rot90`` (a cube-sphere halo). Each against
one process in fp64 on uneven 2x2 blocks and on blocks with an empty row and column: values and the input's gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import assert_equal_or_refused, case_error, on_blocks

D64 = torch.float64
B, C, H, W, WS = 2, 3, 8, 8, 4
#: even square blocks too: a transposed operand's block there has the shape of another part of the field (it was added
#: to it, silently wrong, before the grid axes' dims were compared)
BLOCKS = {"(5, 3) x (2, 6)": ((5, 3), (2, 6)), "(8, 0) x (3, 5)": ((8, 0), (3, 5)), "(4, 4) x (4, 4)": ((4, 4), (4, 4))}


def _windows(x: torch.Tensor) -> torch.Tensor:
    """Swin's partition of a channels-last field into WS x WS windows, a per-window op, the reverse, the shortcut."""
    h = x.permute(0, 2, 3, 1)
    win = h.view(B, H // WS, WS, W // WS, WS, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, WS * WS, C)
    win = torch.softmax(win @ win.transpose(1, 2), -1) @ win                 # attention within each window
    back = win.view(B, H // WS, W // WS, WS, WS, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
    return (h + back).permute(0, 3, 1, 2)


def _shifted(x: torch.Tensor) -> torch.Tensor:
    return torch.roll(_windows(torch.roll(x, (-2, -2), (2, 3))), (2, 2), (2, 3))


def _patches(x: torch.Tensor) -> torch.Tensor:
    """einops' ``b c (h p1) (w p2) -> b (h w) (p1 p2 c)`` by hand, then a Linear: tokens as a flattened slab."""
    p = 2
    t = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(B, (H // p) * (W // p), p * p * C)
    return t @ torch.linspace(-1, 1, p * p * C * 5, dtype=D64).view(p * p * C, 5)


def _cube_halo(x: torch.Tensor) -> torch.Tensor:
    """A face's column halo from its neighbour turned by rot90 (rows beside columns), joined along a block dim."""
    turned = torch.rot90(x * 2, 1, (2, 3))
    return torch.cat([turned[..., :, -1:], x, torch.rot90(x, -1, (2, 3))[..., :, :2]], dim=3)


def _window_tokens(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face Swin's order: tokens (B, N, C) from blocks, a window output (a slab) added to them, a pooler."""
    t = x.flatten(2).transpose(1, 2)
    win = _windows(x).flatten(2).transpose(1, 2)
    return F.adaptive_avg_pool1d((t + win).transpose(1, 2), 1)


def _cases_body(sizes) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    x0 = torch.randn(B, C, H, W, dtype=D64, generator=torch.Generator().manual_seed(5))

    cases = {
        "windows": _windows,
        "shifted windows": _shifted,
        "patches": _patches,
        "flip lat": lambda x: x.flip(2) * x,
        "flip both and channels": lambda x: torch.flip(x, (1, 2, 3)) + x,
        "rot90 k=1, 2, 3": lambda x: torch.rot90(x, 1, (2, 3)) * 3 + torch.rot90(x, 2, (2, 3)) - torch.rot90(x, 3, (2, 3)),
        "pixel shuffle": lambda x: F.pixel_shuffle(x.repeat(1, 4, 1, 1) * 1.5, 2),
        "pixel unshuffle": lambda x: F.pixel_unshuffle(x, 2),
        "back from (channels, lon) blocks": lambda x: (domain.redistribute(x, dims=(1, 3)) if hasattr(x, "spec") else x)
        * 2 + x,
        "x + x.mT": lambda x: x + x.transpose(2, 3) * 2,
        "stack": lambda x: torch.stack([x, x * 2, torch.rot90(x, 1, (2, 3))], 1),
        "cube halo": _cube_halo,
        "a slab meets blocks": lambda x: x * 2 + (domain.redistribute(x, dim=2) if hasattr(x, "spec") else x).sin(),
        "window tokens and a pooler": _window_tokens,
        "a pooler over channels": lambda x: F.adaptive_avg_pool1d(x.flatten(2).transpose(1, 2), 2),
        "a pooler to 3 along tokens": lambda x: F.adaptive_avg_pool1d(x.flatten(2), 3),
    }
    errors = {name: case_error(on_blocks(fn, sizes), x0, i) for i, (name, fn) in enumerate(cases.items())}
    DistributedManager.shutdown()
    return errors


@pytest.mark.parametrize("layout", list(BLOCKS))
def test_windows_patches_and_turned_faces_on_blocks_equal_one_process(ranks, layout):
    for errors in ranks.run(4, _cases_body, BLOCKS[layout]):
        assert_equal_or_refused(errors, {"a pooler to 3 along tokens": "torch.adaptive_avg_pool1d to 3 outputs"}, 1e-12)
