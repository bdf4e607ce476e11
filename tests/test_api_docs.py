"""docs/api.md is generated from the code; it must be current, and every public name documented.

The style rule is a docstring with a usage line on every public function and class, so a
newcomer reading `help(name)` or the reference sees how to call it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_api_docs  # noqa: E402


def test_api_reference_is_current():
    assert (ROOT / "docs" / "api.md").read_text() == gen_api_docs.render(), \
        "docs/api.md is stale: run python scripts/gen_api_docs.py"


def test_every_public_callable_has_a_docstring_with_a_usage_line():
    missing = []
    for package in gen_api_docs.PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            if "Usage" not in (inspect.getdoc(obj) or ""):
                missing.append(f"{package}.{name}")
    assert not missing, f"public names without a 'Usage' line in their docstring: {missing}"
