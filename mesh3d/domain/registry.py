"""The op registry: torch functions → rules that compute them on domain-sharded tensors.

Usage::

    from mesh3d.domain.registry import register
    @register(torch.nn.functional.conv2d)
    def conv2d_rule(input, weight, bias=None, ...): ...

``dispatch`` (called from ``DomainTensor.__torch_function__``) picks, in order: a registered rule;
a metadata query (``.shape``, ``.dtype`` ...: answered from the local shard); for replicated
values only, the op itself (every rank holds the same value, so any op is right); otherwise it
raises ``NotImplementedError`` naming the op, so an unsupported op is never silently wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass

__all__ = ["RULES", "dispatch", "flat_tensors", "op_name", "register", "replicated_dtensor_to_local", "tree_map"]

RULES: dict[Callable, Callable] = {}

# Queries whose answer is about the local shard and contains no tensor data to get wrong.
_METADATA_NAMES = (
    "shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout", "grad",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "output_nr", "_base", "is_nested",
    # autograd bookkeeping that torch itself reads and writes during in-place ops and hook registration
    "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "_grad", "_grad_fn", "is_cpu",
)
_METADATA: set = set()
for _name in _METADATA_NAMES:
    _attr = getattr(torch.Tensor, _name, None)
    if _attr is not None and hasattr(_attr, "__get__"):
        _METADATA.add(_attr.__get__)
        if hasattr(_attr, "__set__"):
            _METADATA.add(_attr.__set__)
_METADATA.update(
    getattr(torch.Tensor, n)
    for n in (
        "dim", "size", "stride", "is_contiguous", "element_size", "data_ptr", "is_floating_point", "is_complex",
        "backward", "retain_grad", "register_hook", "get_device", "__hash__", "__format__", "storage_offset",
        "requires_grad_", "untyped_storage", "__reduce_ex__", "__deepcopy__", "__setstate__",
    )
    if hasattr(torch.Tensor, n)
)
# Their function forms too: FSDP's mixed precision asks torch.is_floating_point(x) of every input.
_METADATA.update((torch.is_floating_point, torch.is_complex))


def register(*funcs: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated rule for every function in ``funcs``."""

    def deco(rule: Callable) -> Callable:
        for f in funcs:
            RULES[f] = rule
        return rule

    return deco


def op_name(func: Callable) -> str:
    """A readable name such as ``torch.flip``, ``torch.Tensor.add`` or ``torch.nn.functional.conv2d``."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    name = name.replace("_VariableFunctionsClass.", "").replace("TensorBase.", "Tensor.")
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch._C") or not module:
        return f"torch.{name}"
    return f"{module}.{name}"


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf of nested lists/tuples/dicts."""
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda o: out.append(o) if isinstance(o, torch.Tensor) else None, obj)
    return out


def replicated_dtensor_to_local(o: Any) -> Any:
    """A DTensor replicated on every mesh dim (a ``"replicate"``-style parameter on the model axis) → its local tensor.

    Every model rank holds the same value and computes the same thing with it, so the local
    tensor is the whole parameter, and ``to_local``'s backward hands the gradient back as a
    ``Replicate`` DTensor. Sharded DTensors are left alone: the op then fails loudly rather
    than computing with a shard as if it were whole.
    """
    if isinstance(o, torch.Tensor) and type(o).__name__ == "DTensor":
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(o, DTensor) and all(isinstance(p, Replicate) for p in o.placements):
            return o.to_local()
    return o


def dispatch(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    from mesh3d.domain.tensor import DomainTensor, adopt, unwrap

    if func in _METADATA:
        # On the DomainTensor object itself, not an unwrapped alias: autograd hooks
        # (``register_hook``, which FSDP2 uses to re-gather parameters before backward),
        # ``retain_grad`` and ``.grad`` must attach to the node the graph actually runs through.
        with disable_torch_function_subclass():
            return func(*args, **kwargs)
    args, kwargs = tree_map(replicated_dtensor_to_local, args), tree_map(replicated_dtensor_to_local, kwargs)
    domain_args = [t for t in flat_tensors((args, kwargs)) if isinstance(t, DomainTensor)]
    rule = RULES.get(func)
    if rule is not None and any(t.spec.dim is not None for t in domain_args):
        return rule(*args, **kwargs)
    if all(t.spec.dim is None for t in domain_args):
        # Replicated values: identical on every rank, so the plain op is the one-process op.
        from mesh3d.domain.collectives import scale_grad

        spec = domain_args[0].spec
        size = spec.comm.size

        def prepare(o):
            # Parameters meeting a replicated value: each of the D ranks computes the same thing, so
            # each keeps 1/D of their gradient (the domain sum then gives the one-process gradient).
            if isinstance(o, torch.Tensor) and not isinstance(o, DomainTensor) and o.requires_grad and size > 1:
                return scale_grad(o, 1.0 / size)
            return unwrap(o)

        out = func(*tree_map(prepare, args), **tree_map(prepare, kwargs))
        plain_inputs = tuple(t for t in flat_tensors((args, kwargs)) if not isinstance(t, DomainTensor))
        return tree_map(lambda o: adopt(o, spec, plain_inputs) if isinstance(o, torch.Tensor) else o, out)
    raise NotImplementedError(
        f"{op_name(func)} has no domain rule: mesh3d will not run it on a domain-sharded tensor "
        f"(sharded dim {[t.spec.dim for t in domain_args if t.spec.dim is not None][0]}) because the local answer "
        "would differ from the one-process answer. Call .full_tensor() first, or register a rule with "
        "mesh3d.domain.registry.register"
    )
