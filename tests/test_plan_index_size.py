"""``index.json``'s size is counted without dumping it (``mesh3d.planner.ckpt_index.indented_size``): the count equals
the length and lines of ``json.dumps(value, indent=1)`` for any JSON value, not only the chunk records it was written
for (escapes, unicode, empty and nested containers, floats)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from profiles import examples

from mesh3d.planner.ckpt_index import indented_size

_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text()
_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=5), max_leaves=25)


@settings(max_examples=examples(400))
@given(_VALUES)
def test_the_counted_size_is_the_dumped_size(value):
    text = json.dumps(value, indent=1, sort_keys=True)
    assert indented_size(value) == (len(text), text.count("\n") + 1)


def test_a_chunk_record_is_counted_as_dumped():
    record = {"checksums": ["0" * 16] * 3, "data_offsets": [4096, 4096 + 5 * 2**20],
              "file": "params/r00007-of-04096.safetensors", "key": "layers.3.attn.wq.weight", "offsets": [0, 512],
              "shape": [256, 4096]}
    text = json.dumps(record, indent=1, sort_keys=True)
    assert indented_size(record) == (len(text), text.count("\n") + 1)
