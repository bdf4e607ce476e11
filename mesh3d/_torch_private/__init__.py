"""Every private PyTorch API that mesh3d relies on, in one place: this package, one module per area.

Each function says which private name it touches and why no public API serves. If a torch upgrade breaks
mesh3d, this is the first place to look; no other module of mesh3d imports a private torch name
(``tests/test_codebase.py`` checks).
"""

from mesh3d._torch_private.distributed import (
    clear_dtensor_caches, default_store, flatten_mesh, gloo_backend, group_options, live_process_groups,
    local_shape_and_global_offset, post_barrier, python_group_private_names, unflatten_mesh, wait_async_collective)
from mesh3d._torch_private.autograd import (
    checkpoint_module, disable_torch_function_subclass, function_apply_key, functorch_transform_active,
    linear_not_a_view, outside_transforms, own_output, patch_checkpoint_recomputation, route_autograd_function_calls,
    run_autograd_function, run_backward_from, run_grad_from, unpatch_checkpoint_recomputation, unroute_autograd_function_calls)
from mesh3d._torch_private.compile import (
    PAD_BUILTIN, autograd_inside_custom_op, call_without_compiling, constant_in_compiled_graphs, data_dependent_errors,
    keep_in_program_order, let_compiled_graphs_take_function_subclasses, never_compiled_alone, never_traced,
    random_draws_saved_under_traced_checkpoints,
    run_compiled_graphs_without_subclass_dispatch, saved_under_traced_checkpoints,
    traced_graph_input_with_history)
from mesh3d._torch_private.kernels import (
    cpu_flash_attention, cpu_flash_attention_backward, cuda_attention_ops, cuda_cudnn_backward, cuda_cudnn_forward,
    cuda_efficient_attention, cuda_efficient_backward, cuda_efficient_forward, cuda_flash_attention, cuda_flash_backward,
    cuda_flash_forward, cuda_sdpa_choice, efficient_lse_rows)
from mesh3d._torch_private.dispatch import (
    ARGUMENTS_TORCH_DROPS, OpOverload, OpOverloadPacket, TRUTH_REDUCTIONS, TorchDispatchMode, argument_torch_dropped,
    builtins_replaced_by, custom_op_overload, is_operator, make_wrapper_tensor, op_schema, outside_dispatch_modes,
    running_compiled_backward, storage_key, tree_flatten, tree_map, view_base)

__all__ = [
    "ARGUMENTS_TORCH_DROPS",
    "argument_torch_dropped",
    "PAD_BUILTIN",
    "OpOverload",
    "OpOverloadPacket",
    "TRUTH_REDUCTIONS",
    "TorchDispatchMode",
    "builtins_replaced_by",
    "autograd_inside_custom_op",
    "call_without_compiling",
    "constant_in_compiled_graphs",
    "checkpoint_module",
    "clear_dtensor_caches",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cuda_attention_ops",
    "cuda_cudnn_backward",
    "cuda_cudnn_forward",
    "cuda_efficient_attention",
    "cuda_efficient_backward",
    "cuda_efficient_forward",
    "cuda_flash_attention",
    "cuda_flash_backward",
    "cuda_flash_forward",
    "cuda_sdpa_choice",
    "custom_op_overload",
    "data_dependent_errors",
    "default_store",
    "disable_torch_function_subclass",
    "efficient_lse_rows",
    "flatten_mesh",
    "function_apply_key",
    "functorch_transform_active",
    "gloo_backend",
    "group_options",
    "is_operator",
    "keep_in_program_order",
    "let_compiled_graphs_take_function_subclasses",
    "linear_not_a_view",
    "never_compiled_alone",
    "never_traced",
    "outside_transforms",
    "live_process_groups",
    "make_wrapper_tensor",
    "local_shape_and_global_offset",
    "op_schema",
    "outside_dispatch_modes",
    "own_output",
    "patch_checkpoint_recomputation",
    "post_barrier",
    "python_group_private_names",
    "route_autograd_function_calls",
    "run_autograd_function",
    "running_compiled_backward",
    "run_backward_from",
    "run_grad_from",
    "run_compiled_graphs_without_subclass_dispatch",
    "random_draws_saved_under_traced_checkpoints",
    "saved_under_traced_checkpoints",
    "storage_key",
    "tree_flatten",
    "traced_graph_input_with_history",
    "tree_map",
    "unflatten_mesh",
    "unpatch_checkpoint_recomputation",
    "unroute_autograd_function_calls",
    "view_base",
    "wait_async_collective",
]
