"""torch-harmonics' example models for the zoo (issue 67): tiny configs on a 16 x 32 equiangular grid, run unchanged on
latitude slabs. Each computes in float32 whatever its parameters' dtype (its attention kernels are float32 on CPU,
its DISCO layers meet float32 quadrature buffers), so the zoo runs them in float32 in one process and on the domain.

Usage: ``ZOO["torch_harmonics.LSNO"].build()``
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

NLAT, NLON = 16, 32


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library's notes said at every layer it builds (its default truncation changed in 0.9.0, the cutoff it
    chose), silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def lsno() -> torch.nn.Module:
    from torch_harmonics.examples.models.lsno import LocalSphericalNeuralOperator

    with _quiet():
        return LocalSphericalNeuralOperator(img_size=(NLAT, NLON), in_chans=3, out_chans=3, embed_dim=8, num_layers=2,
                                            scale_factor=2)


def s2unet() -> torch.nn.Module:
    from torch_harmonics.examples.models.s2unet import SphericalUNet

    with _quiet():
        return SphericalUNet(img_size=(NLAT, NLON), in_chans=3, out_chans=3, embed_dims=[4, 8], depths=[1, 1],
                             scale_factor=1, drop_conv_rate=0.0, drop_path_rate=0.0, drop_dense_rate=0.0)


def s2transformer(attention_mode: str) -> torch.nn.Module:
    from torch_harmonics.examples.models.s2transformer import SphericalTransformer

    with _quiet():
        return SphericalTransformer(img_size=(NLAT, NLON), in_chans=3, out_chans=3, embed_dim=8, num_layers=1,
                                    scale_factor=2, attention_mode=attention_mode)


def s2segformer() -> torch.nn.Module:
    from torch_harmonics.examples.models.s2segformer import SphericalSegformer

    with _quiet():
        return SphericalSegformer(img_size=(NLAT, NLON), in_chans=3, out_chans=3, embed_dims=[4, 8], heads=[1, 1],
                                  depths=[1, 1], scale_factor=2, drop_path_rate=0.0)
