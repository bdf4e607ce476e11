"""The compile step of ``parallelize``: ``torch.compile`` each block of the model, in place, before FSDP wraps it.

Usage (inside ``parallelize``; users write ``Plan(compile=True)`` or ``Plan(compile={"backend": "aot_eager"})``)::

    apply_compile(model, blocks=compiled_blocks(model, resolved.units), options={})

NOTE (torchtitan's order): tensor parallelism, then activation checkpointing, then compile, then FSDP. Each block
is compiled on its own (``nn.Module.compile``: the module and its parameter names stay as they are, so state dicts
and checkpoints do not change), not the whole model: FSDP's all-gathers and reduce-scatters run between blocks, in
eager hooks, and a graph break in one block costs that block only. Compiling a block that already holds DTensor
parameters (after TP) lets Dynamo trace the DTensor ops; domain tensors flowing through a block compile through
their dispatcher (docs/domain.md, "torch.compile").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from mesh3d._torch_private import disable_torch_function_subclass, never_traced, view_base
from mesh3d.domain.dispatch.compile_guards import guard_filter
from mesh3d.domain.core.trees import tree_map
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap

__all__ = ["COMPILE_OPTIONS", "apply_compile", "compiled_blocks", "compile_options"]

#: The ``torch.compile`` keyword arguments ``Plan.compile`` may give.
COMPILE_OPTIONS = ("backend", "fullgraph", "dynamic", "mode", "options")


def compile_options(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``Plan.compile`` as ``torch.compile`` keyword arguments (None: no compile); raises naming what is wrong.

    Usage: ``compile_options({"backend": "aot_eager"})  # {"dynamic": False, "backend": "aot_eager"}``
    """
    if value is False or value is None:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):  # checked before any work: Plan.__post_init__ calls this
        raise TypeError(f"Plan.compile must be True, False or a dict of torch.compile options, got {value!r}")
    unknown = sorted(set(value) - set(COMPILE_OPTIONS))
    if unknown:
        raise ValueError(f"Plan.compile has unknown torch.compile options {unknown}; the ones it takes: "
                         f"{', '.join(COMPILE_OPTIONS)}")
    # NOTE: static shapes unless asked otherwise: a domain rule plans its halos from sizes, and a sharded block's
    # sizes change only with the layout (a recompile then, as for a new shape).
    return {"dynamic": False, **value}


def compiled_blocks(model: nn.Module, units: list[str]) -> list[str]:
    """The modules to compile: the outermost non-root FSDP units (the blocks), or the whole model when there are none.

    Usage: ``compiled_blocks(model, ["layers.0", "layers.1", ""])  # ["layers.0", "layers.1"]``
    """
    blocks = [u for u in units if u]
    outermost = [u for u in blocks if not any(u.startswith(other + ".") for other in blocks if other != u)]
    return sorted(outermost, key=[n for n, _ in model.named_modules()].index) or [""]


def apply_compile(model: nn.Module, blocks: list[str], options: dict[str, Any]) -> None:
    """``torch.compile`` each of ``blocks`` (FQNs; ``""`` is the model itself) in place with ``options``."""
    for fqn in blocks:
        block = model.get_submodule(fqn)
        if type(block).__module__.startswith("torch."):
            # NOTE: Dynamo skips torch's own frames where torch.compile enters them (nn.Module._call_impl, then
            # Sequential.forward or Conv2d.forward), so nn.Module.compile of a torch.nn block compiles nothing
            # (torch 2.13: no graph). Its forward compiled as a function is traced; its hooks then run eagerly.
            block.forward = torch.compile(block.forward, **_with_guard_filter(options))
        else:
            block.compile(**_with_guard_filter(options))
        # NOTE: registered before FSDP's own hooks (fully_shard comes next), so it runs before FSDP's post-forward.
        block.register_forward_hook(_fresh_domain_outputs)


def _with_guard_filter(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``domain.guard_filter`` as Dynamo's guard filter, unless the user set one (or a ``mode``:
    torch takes ``mode`` or ``options``, not both). A copy: ``torch.compile`` pops the filter from the dict it gets."""
    if "mode" in options:
        return dict(options)
    return {**options, "options": {"guard_filter_fn": guard_filter, **options.get("options", {})}}


@never_traced("mesh3d: re-makes a compiled block's outputs as fresh domain tensors, eagerly")
def _fresh_domain_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """The compiled block's domain-tensor outputs as fresh tensors, not alias views of the graph's outputs.

    NOTE: a compiled graph returns plain tensors, which Dynamo's code makes domain tensors with ``as_subclass``: an
    alias view. FSDP2 registers its "re-gather the parameters before backward" hook on each unit's output, and an
    in-place op on a view (the ``ReLU(inplace=True)`` after the block) drops it: backward would then run on freed
    parameters. The view's base is the graph's own fresh output, held by nobody else: it becomes the domain tensor.
    ``nn.Module.compile`` compiles the hooks with the forward, so this one is marked to run eagerly, after the graph.
    """
    def fresh(t: Any) -> Any:
        if not isinstance(t, DomainTensor):
            return t
        base = view_base(t)
        local = unwrap(t)
        if type(base) is not torch.Tensor or base.shape != local.shape or base.stride() != local.stride() \
                or base.storage_offset() != local.storage_offset() or base.requires_grad != local.requires_grad:
            return t
        if base.requires_grad and _viewed_node(t) is not base.grad_fn:
            return t  # NOTE: ``_base`` is the root of a chain of views, not the graph output (below)
        if base.requires_grad and _made_by_a_function(t):
            return t  # NOTE: a view made by an autograd.Function after the graph (a gradient scale): its node counts
        return adopt(base, t.spec)

    return tree_map(fresh, output)


def _made_by_a_function(t: DomainTensor) -> bool:
    """Whether ``t``'s autograd node is a custom ``autograd.Function``'s, not an alias node.

    NOTE: a tensor-parallel output hook runs before this one and may hand over ``x.view_as(x)`` from a gradient-scaling
    Function applied to the graph's output: a view of that output whose own node is the Function's. Taking the base
    then dropped the 1/D scale (a ViT's head under TP x domain trained with gradients 2x and 4x one process's,
    tests/test_domain_compile.py), once torch.nn blocks were compiled at all."""
    with disable_torch_function_subclass():
        return isinstance(t.grad_fn, BackwardCFunction)


def _viewed_node(t: DomainTensor) -> Any:
    """The autograd node ``t``'s own alias node leads to: the graph output's, when ``t`` aliases it directly.

    NOTE: when the graph output is itself a view (a gradient-scaling identity returns ``x.view_as(x)``), ``_base``
    is the root of the chain, and taking it would drop every node in between: the compiled head of a ViT after
    global pooling lost its 1/D gradient scale under Inductor (gradients off by the domain size, caught by
    tests/test_domain_compile.py)."""
    with disable_torch_function_subclass():
        node = t.grad_fn
    return node.next_functions[0][0] if node is not None and node.next_functions else None
