"""What lets mesh3d's compile path run on an older torch (2.11, the GPU image's), checked on the torch the suite runs.

The fallbacks themselves run only where torch needs them; these tests check the logic they rely on, which any torch
can check: a freshly fetched method-wrapper is found by equality, the rule lookup goes by table name, and the compiled-
graph wrapper patches nothing on a torch that wraps graphs itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.output_graph import OutputGraph

from mesh3d._torch_private import run_compiled_graphs_without_subclass_dispatch
from mesh3d.domain.dispatch import queries as func_groups
from mesh3d.domain import guard_filter
from mesh3d.domain.dispatch.queries import GLOBAL_SIZES, METADATA, is_global_size, is_metadata
from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, RuleTable, _rule_index_at_trace_time


def test_tracing_membership_finds_each_query_fetched_anew_and_nothing_else():
    # NOTE: each access to a slot's __get__ makes a new method-wrapper: identity fails where equality holds
    fresh = [torch.Tensor.dtype.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
             torch.Tensor.grad.__set__]  # type: ignore[attr-defined]
    assert not any(f is m for f in fresh for m in METADATA)  # none is the very object listed
    for f in fresh:
        assert func_groups._equal_to_any(f, func_groups._METADATA_LISTED)
        assert is_metadata(f)
        assert not func_groups._equal_to_any(f, func_groups._GLOBAL_SIZES_LISTED)
    for f in (torch.Tensor.shape.__get__, torch.Tensor.size, torch.numel, torch.Tensor.nbytes.__get__):  # type: ignore[attr-defined]
        assert func_groups._equal_to_any(f, func_groups._GLOBAL_SIZES_LISTED) and is_global_size(f)
        assert not func_groups._equal_to_any(f, func_groups._METADATA_LISTED)
    for op in (torch.add, torch.Tensor.add, F.conv2d, torch.Tensor.sum, torch.Tensor.data.__get__):  # type: ignore[attr-defined]
        assert not func_groups._equal_to_any(op, func_groups._METADATA_LISTED + func_groups._GLOBAL_SIZES_LISTED)
        assert not is_metadata(op) and not is_global_size(op)
    assert len(func_groups._METADATA_LISTED) == len(METADATA) and not METADATA & GLOBAL_SIZES


def test_a_compiled_rule_lookup_names_its_table_and_finds_the_eager_rule():
    at = _rule_index_at_trace_time("RULES", F.conv2d)
    assert at >= 0 and RULES._listed[at] is RULES.get(F.conv2d)
    assert _rule_index_at_trace_time("RULES", test_a_compiled_rule_lookup_names_its_table_and_finds_the_eager_rule) == -1
    block_at = _rule_index_at_trace_time("BLOCK_RULES", F.conv2d)
    assert BLOCK_RULES._listed[block_at] is BLOCK_RULES.get(F.conv2d) is not RULES.get(F.conv2d)
    with pytest.raises(ValueError, match="'RULES' exists already"):
        RuleTable("RULES")


def test_the_compiled_graph_wrapper_patches_nothing_where_torch_wraps_graphs_itself():
    before = OutputGraph.call_user_compiler
    patched = run_compiled_graphs_without_subclass_dispatch()
    assert patched is (torch.__version__ < (2, 13))
    if not patched:
        assert OutputGraph.call_user_compiler is before


def test_guard_filter_drops_mesh3d_dataclass_defaults_and_keeps_the_users():
    """torch 2.11 guards the field defaults of the dataclasses a trace constructs (``Step``, ``Window``) through a
    Python lambda per call; mesh3d's never change while a process runs, a user's may be theirs to change."""
    def entry(name: str, kind: str = "NONE_MATCH") -> SimpleNamespace:
        return SimpleNamespace(name=name, guard_type=kind, is_global=True)

    ours = "___dataclass_fields(G['__import_mesh3d_dot_domain_dot_ops_dot_conv'].Step)[4].default"
    users = "___dataclass_fields(G['__import_my_model'].Config)[0].default"
    spec_value = "L['x']._spec.dim"
    assert guard_filter([entry(ours), entry(users), entry(spec_value, "CONSTANT_MATCH")]) == [False, True, True]
