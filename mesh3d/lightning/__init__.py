"""mesh3d for Lightning: ``MeshStrategy``, a Trainer strategy on the (batch, domain, model) mesh.

An optional extra (``pip install mesh3d[lightning]``): the core of mesh3d never imports Lightning.

Usage::

    import lightning.pytorch as pl
    from mesh3d.lightning import MeshStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=MeshStrategy(batch=2, model=2, plan=plan))
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "mesh3d.lightning needs Lightning: pip install 'mesh3d[lightning]' (or pip install 'lightning>=2.4')"
    ) from err

from mesh3d.lightning.strategy import MeshStrategy

__all__ = ["MeshStrategy"]
