"""The JSON form of Lightning's trainer state: every value type Lightning puts in a checkpoint round-trips."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d.lightning.trainer_state import decode_trainer_state, encode_trainer_state
from profiles import examples


def _roundtrip(state):
    return decode_trainer_state(json.loads(json.dumps(encode_trainer_state(state), allow_nan=False)))


def test_a_real_lightning_checkpoint_dict_round_trips():
    state = {
        "epoch": 1, "global_step": 6, "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 2}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}": {
            "best_model_score": torch.tensor(0.125, dtype=torch.float64), "best_k_models": {"a.ckpt": torch.tensor(0.5)},
            "kth_value": torch.tensor(math.inf), "dirpath": "/ckpts"}},
        "lr_schedulers": [{"base_lrs": [0.003], "last_epoch": 6, "_step_count": 7, "milestones": {3: 1, 5: 2}}],
        "hyper_parameters": {"dtype": torch.float64, "sizes": (2, 2)},
        "window": torch.arange(4.0),
    }
    back = _roundtrip(state)
    cb = back["callbacks"]["ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}"]
    assert cb["best_model_score"].dtype == torch.float64 and cb["best_model_score"].item() == 0.125
    assert cb["kth_value"].item() == math.inf
    assert back["lr_schedulers"][0]["milestones"] == {3: 1, 5: 2}  # int keys stay ints (MultiStepLR)
    assert back["hyper_parameters"] == {"dtype": torch.float64, "sizes": (2, 2)}
    assert torch.equal(back["window"], torch.arange(4.0))
    assert back["loops"] == state["loops"] and back["epoch"] == 1


def test_a_value_json_cannot_hold_names_its_key():
    with pytest.raises(TypeError, match=r"callbacks\.MyCallback\.handle.*no pickles"):
        encode_trainer_state({"callbacks": {"MyCallback": {"handle": object()}}})


def test_hyperparameters_json_cannot_hold_are_kept_as_text_with_a_warning():
    with pytest.warns(UserWarning, match="hyper_parameters"):
        doc = encode_trainer_state({"hyper_parameters": {"net": torch.nn.Linear(1, 1)}})
    assert "Linear" in decode_trainer_state(doc)["hyper_parameters"]


_leaves = st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False) | st.text(max_size=8)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(st.text(max_size=10), _values, max_size=5))
def test_any_nesting_of_json_types_tuples_and_int_keys_round_trips(state):
    assert _roundtrip(state) == state
