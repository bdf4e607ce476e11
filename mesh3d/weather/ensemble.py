"""Ensemble members that are the same on every mesh: seeded perturbations of the initial state, the model's own noise.

A member is keyed by ``(seed, member number, init time)``. Every random field it draws is keyed by that and a
stream (0: the initial perturbation; ``k``: the model's noise at lead ``k``), and the ``j``-th draw of a stream by
``j``; the field is drawn row by row, row ``r`` of channel ``c`` being::

    numpy.random.Generator(numpy.random.Philox(key=key, counter=[0, 0, r, c])).standard_normal(W)

with ``key = SeedSequence([seed, member, init_ns mod 2**64, stream, j]).generate_state(2, uint64)``. A rank draws
only its own rows (whole rows where longitude is split, keeping its columns), so no rank draws the whole field, and
the value at a point depends on the member's key and the point only: never on the mesh, the number of ranks or
which members share a batch.

Usage::

    keys = [MemberKey(seed=0, member=m, init=np.datetime64("2020-01-10T00")) for m in range(4)]
    x = perturb_initial(x, keys, 0.05)                  # x + 0.05 * N(0, 1), each member its own field
    noise = MemberNoise(keys, stream=lead)              # what forecast_ensemble hands a stochastic model
    z = noise.normal(h)                                 # laid out like h (plain, slabs or blocks), its own draw each call
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from mesh3d.weather.layout import block_of, relayout_like

__all__ = ["MemberKey", "MemberNoise", "Perturbation", "field_normal", "perturb_initial"]

#: A Gaussian scale (one for every channel, or one per channel, in the model's normalized units) or a function
#: ``f(x, noise) -> x'`` of the batch of initial states and its :class:`MemberNoise`.
Perturbation = Union[float, Sequence[float], Callable[[torch.Tensor, "MemberNoise"], torch.Tensor], None]

_TORCH_DRAW = 2 ** 32  # NOTE: the draw number of torch's seed: above any draw a model makes with normal()


@dataclass(frozen=True)
class MemberKey:
    """What a member's random draws depend on: the run's seed, the member number and the init time.

    Usage: ``MemberKey(0, 3, np.datetime64("2020-01-10T00")).words(stream=0, draw=0)``
    """

    seed: int
    member: int
    init: Any

    def __post_init__(self) -> None:
        if int(self.seed) < 0 or int(self.member) < 0:
            raise ValueError(f"MemberKey: seed={self.seed} and member={self.member} must be >= 0")

    @property
    def init_ns(self) -> int:
        return int(np.datetime64(self.init, "ns").astype(np.int64))

    def words(self, stream: int, draw: int) -> np.ndarray:
        """The Philox key (two uint64 words) of draw ``draw`` of stream ``stream``."""
        entropy = [int(self.seed), int(self.member), self.init_ns % 2 ** 64, int(stream), int(draw)]
        return np.random.SeedSequence(entropy).generate_state(2, np.uint64)


def field_normal(key: np.ndarray, channels: int, rows: tuple[int, int], cols: tuple[int, int], width: int) -> np.ndarray:
    """Rows ``rows`` and columns ``cols`` of the standard normal ``(channels, H, width)`` field keyed by ``key``: fp64.

    Usage: ``field_normal(MemberKey(0, 1, t).words(0, 0), 4, (0, 16), (32, 64), 64)  # (4, 16, 32)``
    """
    r0, r1 = rows
    c0, c1 = cols
    out = np.empty((channels, max(r1 - r0, 0), max(c1 - c0, 0)))
    if out.size == 0:
        return out
    for c in range(channels):
        for i, r in enumerate(range(r0, r1)):
            bits = np.random.Philox(key=key, counter=np.array([0, 0, r, c], dtype=np.uint64))
            out[c, i] = np.random.Generator(bits).standard_normal(width)[c0:c1]
    return out


class MemberNoise:
    """White noise for a batch of members, each from its own key: what a stochastic model draws its noise from.

    Usage: ``z = noise.normal(h)  # (B, C, H, W) like h; noise.normal(h, channels=2)  # (B, 2, H, W)``

    Each call is the next draw of the stream (a model that calls it twice per step gets two fields); one
    :class:`MemberNoise` is made per lead, so a member's noise at lead ``k`` is the same whatever came before.
    """

    def __init__(self, keys: Sequence[MemberKey], stream: int) -> None:
        self.keys = tuple(keys)
        self.stream = int(stream)
        self.draws = 0

    def normal(self, like: torch.Tensor, channels: int | None = None) -> torch.Tensor:
        """Standard normal ``(B, channels or C, H, W)`` in ``like``'s layout, dtype and device (this rank's block)."""
        (_, width), rows, cols = block_of(like)
        if like.shape[0] != len(self.keys):
            raise ValueError(f"MemberNoise.normal: like= holds {like.shape[0]} states but the noise is for "
                             f"{len(self.keys)} members")
        c = int(like.shape[1] if channels is None else channels)
        draw, self.draws = self.draws, self.draws + 1
        local = np.stack([field_normal(k.words(self.stream, draw), c, rows, cols, width) for k in self.keys])
        device = like.to_local().device if hasattr(like, "to_local") else like.device
        return relayout_like(like)(torch.from_numpy(local).to(dtype=like.dtype, device=device))

    def torch_seed(self) -> int:
        """A seed for torch's generator from the first member's key (the same on every rank of its domain)."""
        return int(self.keys[0].words(self.stream, _TORCH_DRAW)[0] % 2 ** 63)


def perturb_initial(x: torch.Tensor, keys: Sequence[MemberKey], perturbation: Perturbation) -> torch.Tensor:
    """The initial states ``x`` (B, C, H, W) of ``len(keys)`` members, perturbed (stream 0 of each member's key).

    Usage: ``perturb_initial(x, keys, 0.05)``; ``perturb_initial(x, keys, [0.1, 0.05, 0.05])``;
    ``perturb_initial(x, keys, lambda x, noise: x + smooth(noise.normal(x)))``
    """
    if perturbation is None:
        return x
    noise = MemberNoise(keys, stream=0)
    if callable(perturbation):
        out = perturbation(x, noise)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"the perturbation function must return the perturbed states, shape {tuple(x.shape)}; got "
                             f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        return out
    values = np.asarray(perturbation, dtype=np.float64).reshape(-1)
    if values.size not in (1, x.shape[1]):
        raise ValueError(f"a Gaussian perturbation takes one scale or one per channel ({x.shape[1]}), got "
                         f"{values.size} values")
    scale = np.broadcast_to(values, (x.shape[1],))
    z = noise.normal(x)
    return x + torch.as_tensor(np.ascontiguousarray(scale), dtype=x.dtype).reshape(1, -1, 1, 1).to(z.device) * z
