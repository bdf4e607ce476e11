"""What FSDP2 and tensor parallelism add to one rank's step, emulated on the plain model with module hooks.

The simulated model holds every parameter unsharded at its tensor-parallel shape (what FSDP gathers before
a unit runs), so its compute and activations are the rank's own. Around that:

* ``FsdpEmulation`` follows torch 2.13's FSDP2 (``_fsdp_param_group.py``): a unit's gathered parameters are
  allocated at its pre-forward and freed after its forward (``reshard_after_forward``, never for the root),
  the all-gather output of one unit is held until the next unit's copy-out in forward and freed at once in
  backward, the unit's pre-backward gathers again and prefetches the unit that ran before it, and its
  post-backward (an autograd node on its inputs, as FSDP2 registers one) turns the unsharded gradients into
  the reduce-scatter input, keeps one such input in flight, and leaves the sharded gradient buffer behind.
  Each gather and reduction is counted. With a ``param_dtype``, every unit's pre-forward first casts its
  floating-point inputs to it, as ``MixedPrecisionPolicy(cast_forward_inputs=True)`` (FSDP2's default) does.
* ``TpEmulation`` adds the collectives of ``colwise``/``rowwise`` styles: a rowwise module's output is
  all-reduced (a new tensor) in forward, a colwise module's input gradient in backward.

Usage::

    fsdp, tp = FsdpEmulation(layout, plan), TpEmulation(layout)
    handles = fsdp.install(model) + tp.install(model)
    fsdp.start(tracker); loss.backward(); fsdp.finish()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mesh3d.domain.core.tensor import unwrap
from mesh3d.parallel.styles import style_kind
from mesh3d.parallel.validate import PlanFields
from mesh3d.planner.layout import ModelLayout
from mesh3d.planner.tracker import FSDP_BUFFERS, GRADS, MemoryTracker
from mesh3d._torch_private import tree_flatten, tree_map

__all__ = ["FsdpEmulation", "TpEmulation", "Collective"]

#: (axis, collective, phase, message bytes per rank, result bytes per rank)
Collective = tuple[str, str, str, int, int]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's data (a domain tensor's local shard: its shape may describe the whole tensor)."""
    local = unwrap(t)
    return local.numel() * local.element_size()


def _tensors_needing_grad(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done (FSDP2's own device)."""

    @staticmethod
    def forward(ctx, emulation: FsdpEmulation, unit: str, *inputs: torch.Tensor):
        ctx.emulation, ctx.unit = emulation, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.emulation.post_backward(ctx.unit)
        return (None, None, *grads)


class FsdpEmulation:
    """FSDP2's buffers and collectives for one rank's step (see the module docstring)."""

    def __init__(self, layout: ModelLayout, plan: PlanFields) -> None:
        self.layout = layout
        s = layout.sharding
        self.shard = s.shard
        self.axis = "batch×domain" if s.mode == "fsdp" else f"batch×domain/shard({s.shard})"
        self.replicate_axis = f"batch×domain/replicate({s.replicas})"
        param_dtype = getattr(plan, "param_dtype", None)
        reduce_dtype = getattr(plan, "reduce_dtype", None)
        reshard = getattr(plan, "reshard_after_forward", True)
        self.param_dtype = param_dtype
        self.sizes: dict[str, dict[str, int]] = {}
        self.pieces: dict[str, list[int]] = {}
        for unit in layout.units:
            params = layout.unit_params(unit)
            shard_numel = [layout.chunk(p) * layout.rest(p) for p in params]
            dtypes = {param_dtype or p.dtype for p in params}
            ag_item = (param_dtype or params[0].dtype).itemsize if len(dtypes) == 1 else 1  # mixed dtypes go as bytes
            ag_in = sum(n * ((param_dtype or p.dtype).itemsize if ag_item == 1 else 1) for n, p in zip(shard_numel, params))
            grad = [(n, p) for n, p in zip(shard_numel, params) if p.requires_grad]
            reduce_item = (reduce_dtype or param_dtype or params[0].dtype).itemsize if params else 0
            item = lambda p: (param_dtype or p.dtype).itemsize  # noqa: E731
            # NOTE: FSDP2 allocates each parameter's unsharded (padded) tensor separately: the allocator rounds each.
            self.pieces[unit] = [n * item(p) * self.shard for n, p in zip(shard_numel, params)]
            self.sizes[unit] = {
                "params": len(params),
                "ag_in": ag_in * ag_item,
                "unsharded": ag_in * ag_item * self.shard,
                "rs_out": sum(n for n, _ in grad) * reduce_item,
                "grads": sum(n * p.itemsize for n, p in grad),
                "reshard": int(bool(reshard) and unit != ""),
            }
        self.collectives: list[Collective] = []
        self.tracker: MemoryTracker | None = None
        self._unsharded: set[str] = set()
        self._state: dict[str, str] = {}
        self._post_forward_order: list[str] = []
        self._post_forward_indices: dict[str, list[int]] = {}
        self._held_ag: str | None = None
        self._rs_inputs: list[str] = []
        #: Called with a unit's FQN once its unsharded gradients went into the reduce-scatter input (the
        #: simulation drops them then, as FSDP2 does).
        self.release_grads: Any = None

    # ------------------------------------------------------------------ lifecycle of one step
    def start(self, tracker: MemoryTracker | None) -> None:
        self.tracker = tracker
        self.collectives.clear()
        self._unsharded.clear()
        self._state.clear()
        self._post_forward_order.clear()
        self._post_forward_indices.clear()
        self._held_ag = None
        self._rs_inputs.clear()

    def finish(self) -> None:
        """FSDP2's final backward callback: post-backward of units whose inputs needed no gradient, then release."""
        for unit in self.layout.units:  # deepest first, root last
            if self._state.get(unit) in ("forward", "pre_backward"):
                self.post_backward(unit)
        for name in self._rs_inputs:
            self._free(name)
        self._rs_inputs.clear()
        for unit in list(self._unsharded):
            self._reshard(unit)

    def install(self, model: nn.Module) -> list[Any]:
        handles = []
        for unit in self.layout.units:
            module = model.get_submodule(unit)
            if not self.sizes[unit]["params"]:
                # NOTE: FSDP2 casts a unit's inputs whether or not it holds parameters.
                if self.param_dtype is not None:
                    handles.append(module.register_forward_pre_hook(self._cast_inputs_hook, with_kwargs=True))
                continue
            handles.append(module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True))
            handles.append(module.register_forward_hook(self._post_forward_hook(unit)))
        return handles

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """FSDP2's ``cast_forward_inputs``: floating-point tensors to ``param_dtype`` (integers, e.g. token ids, stay)."""
        if self.param_dtype is None:
            return args, kwargs
        dtype = self.param_dtype
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _cast_inputs_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._cast_inputs(args, kwargs)

    # ------------------------------------------------------------------ buffers
    def _alloc(self, name: str, category: str, nbytes: int, pieces: list[int] | None = None) -> None:
        if self.tracker is not None and nbytes:
            self.tracker.alloc(name, category, nbytes, pieces)

    def _free(self, name: str) -> None:
        if self.tracker is not None:
            self.tracker.free(name)

    def _unshard(self, unit: str, phase: str) -> None:
        if unit in self._unsharded:
            return
        size = self.sizes[unit]
        self._unsharded.add(unit)
        pieces = self.pieces[unit]
        if self.shard == 1:  # a one-rank shard group copies its shard into the unsharded parameters, no all-gather
            self._alloc(f"unsharded {unit}", FSDP_BUFFERS, size["unsharded"], pieces)
            return
        self.collectives.append((self.axis, "all_gather", phase, size["ag_in"], size["unsharded"]))
        if phase == "forward":  # the previous unit's all-gather output is freed at this copy-out, this one's kept
            self._alloc(f"all-gather output {unit}", FSDP_BUFFERS, size["unsharded"])
            if self._held_ag is not None and self._held_ag != unit:
                self._free(f"all-gather output {self._held_ag}")
            self._held_ag = unit
            self._alloc(f"unsharded {unit}", FSDP_BUFFERS, size["unsharded"], pieces)
        else:
            self._alloc(f"unsharded {unit}", FSDP_BUFFERS, size["unsharded"], pieces)
            if self.tracker is not None:
                self.tracker.spike(FSDP_BUFFERS, size["unsharded"])

    def _reshard(self, unit: str) -> None:
        self._unsharded.discard(unit)
        self._free(f"unsharded {unit}")

    # ------------------------------------------------------------------ hooks
    def _pre_forward_hook(self, unit: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            args, kwargs = self._cast_inputs(args, kwargs)  # before the unshard and the post-backward node, as FSDP2
            self._unshard(unit, "forward")
            self._state[unit] = "forward"
            tensors = _tensors_needing_grad((args, kwargs))
            if not tensors:
                return args, kwargs
            wrapped = dict(zip(map(id, tensors), _PostBackward.apply(self, unit, *tensors)))
            swap = lambda t: wrapped.get(id(t), t) if isinstance(t, torch.Tensor) else t
            return tree_map(swap, args), tree_map(swap, kwargs)

        return hook

    def _post_forward_hook(self, unit: str):
        def hook(module: nn.Module, args: tuple, output: Any):
            if self.sizes[unit]["reshard"]:
                self._reshard(unit)
            if unit == "" and self._held_ag is not None:  # the root's post-forward frees the last all-gather output
                self._free(f"all-gather output {self._held_ag}")
                self._held_ag = None
            self._post_forward_indices.setdefault(unit, []).append(len(self._post_forward_order))
            self._post_forward_order.append(unit)
            for t in _tensors_needing_grad(output):
                t.register_hook(lambda grad, unit=unit: self.pre_backward(unit))
            return output

        return hook

    def pre_backward(self, unit: str) -> None:
        if self._state.get(unit) != "forward":
            return
        self._state[unit] = "pre_backward"
        self._unshard(unit, "backward")
        indices = self._post_forward_indices.get(unit)
        if indices:  # FSDP2's default backward prefetch: the unit whose forward ended just before this one's
            index = indices.pop()
            if index > 0 and self._state.get(self._post_forward_order[index - 1]) == "forward":
                self._unshard(self._post_forward_order[index - 1], "backward")

    def post_backward(self, unit: str) -> None:
        if self._state.get(unit) == "post_backward":
            return
        self._state[unit] = "post_backward"
        size = self.sizes[unit]
        self._reshard(unit)
        if not any(p.requires_grad for p in self.layout.unit_params(unit)):
            return
        while self._rs_inputs:  # at most one reduce-scatter input in flight (reduce_scatter_max_input_buffers=1)
            self._free(self._rs_inputs.pop(0))
        self._alloc(f"reduce-scatter input {unit}", FSDP_BUFFERS, size["rs_out"] * self.shard)
        self._rs_inputs.append(f"reduce-scatter input {unit}")
        if self.release_grads is not None:
            self.release_grads(unit)
        self._alloc(f"sharded grads {unit}", GRADS, size["grads"])
        if self.shard > 1:
            self.collectives.append((self.axis, "reduce_scatter", "backward", size["rs_out"] * self.shard, size["rs_out"]))
        if self.layout.sharding.replicas > 1:
            self.collectives.append((self.replicate_axis, "all_reduce", "backward", size["rs_out"], size["rs_out"]))


class _AllReduceGradInBackward(torch.autograd.Function):
    """Identity in forward; in backward the gradient is all-reduced over the model axis (a new tensor)."""

    @staticmethod
    def forward(ctx, emulation: TpEmulation, x: torch.Tensor):
        ctx.emulation = emulation
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        nbytes = _local_bytes(grad)
        ctx.emulation.collectives.append(("model", "all_reduce", "backward", nbytes, nbytes))
        return None, grad.clone()


class TpEmulation:
    """The collectives of ``colwise``/``rowwise`` styles on the model axis (see the module docstring)."""

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout
        self.collectives: list[Collective] = []

    def install(self, model: nn.Module) -> list[Any]:
        if self.layout.mesh.model == 1:
            return []
        handles = []
        for fqn, style in self.layout.styles.items():
            kind = style_kind(style)
            module = model.get_submodule(fqn)
            if kind == "rowwise":
                handles.append(module.register_forward_hook(self._all_reduce_output))
            elif kind == "colwise" and isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(self._all_reduce_input_grad))
        return handles

    def _all_reduce_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        nbytes = _local_bytes(output)
        self.collectives.append(("model", "all_reduce", "forward", nbytes, nbytes))
        return output.clone()

    def _all_reduce_input_grad(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return (_AllReduceGradInBackward.apply(self, x), *args[1:])
        return args
