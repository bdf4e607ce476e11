"""How many examples a hypothesis test draws under the loaded profile (registered in tests/conftest.py).

Usage::

    @settings(max_examples=examples(4), deadline=None)   # 4 in CI, 40 with HYPOTHESIS_PROFILE=thorough
    @given(...)
"""

from __future__ import annotations

from hypothesis import settings

#: The ``ci`` profile's default number of examples; a profile with more scales every test alike.
CI_EXAMPLES = 100


def examples(ci: int) -> int:
    """``ci`` examples under the ``ci`` profile, scaled like the loaded profile's default (``thorough``: 10x)."""
    return max(1, ci * settings.default.max_examples // CI_EXAMPLES)
