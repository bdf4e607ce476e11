"""Bad plans raise a clear error on every rank, before any collective.

"Before any collective" is tested directly: each local check also runs on rank 0 ALONE
(the other ranks never call parallelize); a check behind a collective would wait there for
ranks that never come, and the rank pool's timeout would fail the test naming where it waited.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d import Plan
from profiles import examples


def _cases():
    import torch
    from torch import nn

    import parallel_models as pm

    def transformer(**kw):
        torch.manual_seed(0)
        return pm.Transformer(**kw)

    good = pm.transformer_plan_model()
    return {
        "unmatched": (lambda: transformer(), Plan(model={**good, "layers.*.atn.wq": "colwise"}), ValueError,
                      ["'layers.*.atn.wq' matches no module", "'layers.0.attn.wq'"]),
        "style_on_wrong_module": (lambda: transformer(), Plan(model={"layers.0.ln1": "colwise"}), ValueError,
                                  ["'colwise'", "'layers.0.ln1'", "LayerNorm", "nn.Linear and nn.Embedding"]),
        "not_divisible": (lambda: nn.Sequential(nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 4)),
                          Plan(model={"0": "colwise", "2": "rowwise"}), ValueError,
                          ["0.weight of shape (6, 16)", "dim 0 (size 6)", "model axis of size 4",
                           "sizes that would work: 1, 2, 3, 6"]),
        "heads": (lambda: transformer(n_heads=2), Plan(model=good), ValueError,
                  ["layers.0.attn.n_heads=2", "model axis size 4", "would work: 1, 2"]),
        "empty_model_plan": (lambda: transformer(), Plan(), ValueError, ["model axis has size 4", "Plan.model is empty"]),
        "unit_unmatched": (lambda: transformer(), Plan(model=good, units=["blocks.*"]), ValueError,
                           ["Plan.units pattern 'blocks.*' matches no module"]),
        "checkpoint_unmatched": (lambda: transformer(), Plan(model=good, checkpoint=["layer.*"]), ValueError,
                                 ["Plan.checkpoint pattern 'layer.*'", "'layers"]),
        "hsdp_split": (lambda: transformer(), Plan(model=good, batch="hsdp", hsdp_shard_size=4), ValueError,
                       ["hsdp_shard_size=4 does not divide batch×domain=2", "would work: 1, 2"]),
    }


def _expect(fn, exc, fragments):
    try:
        fn()
    except exc as err:
        message = str(err)
    else:
        raise AssertionError("no error raised")
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message lacks {missing}: {message}"
    return message


def _validation_body():
    import torch.distributed as dist

    from mesh3d import DistributedManager, parallelize

    dm = DistributedManager.initialize(batch=2, domain=1, model=4)
    results = {}
    for name, (build, plan, exc, fragments) in _cases().items():
        results[name] = _expect(lambda: parallelize(build(), plan), exc, fragments)
        # The same check on rank 0 alone: it must not wait for the others.
        if dm.rank == 0:
            results[name + "/alone"] = _expect(lambda: parallelize(build(), plan), exc, fragments)
        dist.barrier()

    import parallel_models as pm

    # Plans that differ between ranks: each is valid, the hash check catches the difference.
    plan = Plan(model=pm.transformer_plan_model(), reshard_after_forward=dm.rank % 2 == 0)
    results["differs"] = _expect(lambda: parallelize(pm.Transformer(), plan), RuntimeError,
                                 ["differs between ranks", "ranks [0, 2, 4, 6]", "ranks [1, 3, 5, 7]"])
    # Parallelizing twice.
    model = parallelize(pm.Transformer(), Plan(model=pm.transformer_plan_model()))
    results["twice"] = _expect(lambda: parallelize(model, Plan(model=pm.transformer_plan_model())), RuntimeError,
                               ["already parallelized"])
    names_after = [n for n, _ in model.named_parameters()]
    assert names_after == [n for n, _ in pm.Transformer().named_parameters()]
    return results


def test_every_validation_error_on_every_rank_before_any_collective(ranks):
    # NOTE: the timeout only bounds a hang (rank 0 alone stuck in a collective); it is no speed limit.
    results = ranks.run(8, _validation_body, timeout=120)
    for rank, per_rank in enumerate(results):
        for name, message in per_rank.items():
            if not name.endswith("/alone") and name != "differs":
                assert message == results[0][name], (rank, name)
    # Rank 0 alone got each local check's error, the same one as with every rank taking part.
    assert all(results[0][k + "/alone"] == results[0][k] for k in _case_names())


def _case_names():
    return ["unmatched", "style_on_wrong_module", "not_divisible", "heads", "empty_model_plan", "unit_unmatched",
            "checkpoint_unmatched", "hsdp_split"]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(model={"x": "diagonal"}), "'diagonal' is not a style"),
    (dict(model={"x": 3}), "must be a style name or a ParallelStyle"),
    (dict(batch="zero3"), "Plan.batch='zero3' must be one of"),
    (dict(batch="fsdp", hsdp_shard_size=2), "only used with batch='hsdp'"),
    (dict(units="layers.*"), "Plan.units must be a list"),
    (dict(batch=None, cpu_offload=True), "need batch='fsdp'"),
])
def test_plan_rejects_bad_fields(kwargs, fragment):
    with pytest.raises((ValueError, TypeError), match=None) as info:
        Plan(**kwargs)
    assert fragment in str(info.value)


@settings(max_examples=examples(40), deadline=None)
@given(out=st.integers(1, 48), inp=st.integers(1, 48), model=st.sampled_from([1, 2, 3, 4, 6, 8]),
       style=st.sampled_from(["colwise", "rowwise"]), embedding=st.booleans())
def test_divisibility_check_is_exact(out, inp, model, style, embedding):
    """Local, no ranks: the plan is refused exactly when the sharded dim is not divisible,
    and the message lists exactly the divisors of that dim."""
    from torch import nn

    from mesh3d.parallel.validate import resolve_plan

    layer = nn.Embedding(out, inp) if embedding else nn.Linear(inp, out)
    root = nn.Sequential(layer)
    dim_size = {("colwise", False): out, ("rowwise", False): inp, ("colwise", True): inp, ("rowwise", True): out}[
        (style, embedding)]
    sizes = {"batch": 1, "domain": 1, "model": model}
    if dim_size % model == 0:
        resolve_plan(Plan(model={"0": style}), root, sizes)
    else:
        with pytest.raises(ValueError) as info:
            resolve_plan(Plan(model={"0": style}), root, sizes)
        divisors = ", ".join(str(d) for d in range(1, dim_size + 1) if dim_size % d == 0)
        assert f"sizes that would work: {divisors}" in str(info.value)
        assert f"0.weight of shape {tuple(layer.weight.shape)}" in str(info.value)
