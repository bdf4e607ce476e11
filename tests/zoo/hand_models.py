"""Hand-written models of the zoo: written as their authors write them, without a library (issue 67).

- Swin's shifted-window attention on (B, H, W, C) and a Pangu-style 3-D window block on (B, Z, H, W, C), from
  ``test_domain_window_attention`` (windows cut by ``view``/``permute`` across shards, shifted by ``torch.roll``);
- a denoising diffusion loss: timesteps and noise drawn per call (``torch.randint``, ``torch.randn_like``), the noisy
  field from a cosine schedule, a small conv net predicting the noise with a sinusoidal time embedding added per
  channel, the squared error per point as the output;
- a cube-sphere conv net (as DLWP's): six faces (B, 6, C, N, N), each padded with its neighbours' edge rows and
  columns turned into its frame by ``torch.rot90``, then one ``Conv2d`` over the faces folded into the batch.

Usage: ``ZOO["hand-written.DiffusionLoss"].build()``
"""

from __future__ import annotations

import math

import torch
from torch import nn

from test_domain_window_attention import EarthBlock, SwinBlock

__all__ = ["cube_sphere", "diffusion_loss", "earth_windows", "swin_windows"]


def swin_windows() -> nn.Module:
    """Two Swin blocks on an 8x8 field of 4 channels, windows of 4, the second shifted by 2 (its mask added per window)."""
    return nn.Sequential(SwinBlock((8, 8)), SwinBlock((8, 8), shift=2))


def earth_windows() -> nn.Module:
    """Two 3-D window blocks on a (4, 8, 8) volume of 4 channels, (2, 4, 4) windows, the second shifted by half."""
    return nn.Sequential(EarthBlock((4, 8, 8)), EarthBlock((4, 8, 8), shift=True))


class DiffusionLoss(nn.Module):
    """DDPM's training loss on fields (B, C, H, W): ``(eps_theta(x_t, t) - eps) ** 2`` per point."""

    def __init__(self, channels: int = 2, width: int = 8, steps: int = 50) -> None:
        super().__init__()
        self.steps = steps
        t = torch.linspace(0, 1, steps + 1)
        alpha_bar = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        self.register_buffer("alpha_bar", (alpha_bar / alpha_bar[0])[1:], persistent=False)
        self.time = nn.Sequential(nn.Linear(16, width), nn.SiLU(), nn.Linear(width, width))
        self.inp = nn.Conv2d(channels, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)
        self.out = nn.Conv2d(width, channels, 3, padding=1)

    def _embedding(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-math.log(1000.0) * torch.arange(8, dtype=self.alpha_bar.dtype) / 8)
        angles = t.to(freqs.dtype)[:, None] * freqs[None]
        return self.time(torch.cat([angles.sin(), angles.cos()], dim=1))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, self.steps, (x0.shape[0],))
        noise = torch.randn_like(x0)
        a = self.alpha_bar[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        h = self.inp(xt) + self._embedding(t)[:, :, None, None]
        return (self.out(nn.functional.silu(self.norm(h))) - noise) ** 2


def diffusion_loss() -> nn.Module:
    return DiffusionLoss()


def _halos(faces: list[torch.Tensor], f: int, p: int) -> tuple[torch.Tensor, ...]:
    """The (top, bottom, left, right) halos of face ``f`` (0-3 round the equator, each east of the one before; 4
    north, 5 south): ``p`` rows or columns of its neighbours, turned into its frame."""
    def turn(g: int, k: int) -> torch.Tensor:
        return torch.rot90(faces[g], k=k, dims=(-2, -1))

    if f < 4:
        return (turn(4, f)[..., -p:, :], turn(5, -f)[..., :p, :], faces[(f - 1) % 4][..., :, -p:],
                faces[(f + 1) % 4][..., :, :p])
    if f == 4:
        return turn(2, 2)[..., -p:, :], faces[0][..., :p, :], turn(3, -1)[..., :, -p:], turn(1, 1)[..., :, :p]
    return faces[0][..., -p:, :], turn(2, 2)[..., :p, :], turn(3, 1)[..., :, -p:], turn(1, -1)[..., :, :p]


def cube_pad(x: torch.Tensor, p: int = 1) -> torch.Tensor:
    """(B, 6, C, N, N) faces padded by ``p`` from their neighbours (corners zero): (B, 6, C, N + 2p, N + 2p)."""
    faces = [x[:, f] for f in range(6)]
    padded = []
    for f in range(6):
        top, bottom, left, right = _halos(faces, f, p)
        corner = torch.zeros_like(top[..., :p])
        padded.append(torch.cat([torch.cat([corner, top, corner], -1), torch.cat([left, faces[f], right], -1),
                                 torch.cat([corner, bottom, corner], -1)], -2))
    return torch.stack(padded, 1)


class CubeConv(nn.Module):
    """A 3x3 convolution on the cube-sphere: halos from the neighbouring faces, one conv over all faces."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(cube_pad(x).flatten(0, 1))
        return y.unflatten(0, (x.shape[0], 6))


def cube_sphere() -> nn.Module:
    """Two cube-sphere convolutions with a GELU between, on 2 channels of 8x8 faces."""
    return nn.Sequential(CubeConv(2, 4), nn.GELU(), CubeConv(4, 2))
