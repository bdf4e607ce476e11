"""Parallelizing a model: one ``Plan`` applied over the (batch, domain, model) mesh by ``parallelize``.

Modules, in the order a call uses them: ``styles`` (the style vocabulary, a leaf), ``plan`` (the
``Plan`` dataclass), ``validate`` (local checks of a plan against a model and mesh sizes),
``explain`` (what a plan does, as a table), ``apply`` (``parallelize`` itself), ``tensor_parallel``
(the model axis), ``batch_parallel`` (the batch axis: FSDP/HSDP/DDP) and ``init`` (mesh-independent
initialization of a meta model).

Usage::

    from mesh3d.parallel import Plan, parallelize
    model = parallelize(model, Plan(model={"layers.*.up": "colwise"}, batch="fsdp"), seed=0)
"""

from mesh3d.parallel.apply import parallelize
from mesh3d.parallel.plan import Plan

__all__ = ["Plan", "parallelize"]
