#!/usr/bin/env python
"""Write docs/api.md: every public name of mesh3d, mesh3d.domain, mesh3d.checkpoint and mesh3d.lightning.

Usage::

    python scripts/gen_api_docs.py            # rewrite docs/api.md
    python scripts/gen_api_docs.py --check    # exit 1 if docs/api.md is out of date (tests run this)

Generated rather than hand-written so the reference cannot drift from the code: the names are
each package's ``__all__``, and each entry is the signature and the docstring as written.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mesh3d", "mesh3d.domain", "mesh3d.checkpoint", "mesh3d.data", "mesh3d.weather", "mesh3d.lightning",
            "mesh3d.planner", "mesh3d.graphs")
HEADER = """<!-- doc-test: page not run: the python blocks of this page are signatures, generated from the code -->
# API reference

Generated from the code by `scripts/gen_api_docs.py` (a test fails when this file is stale).
Every public name of `mesh3d`, `mesh3d.domain`, `mesh3d.checkpoint`, `mesh3d.data`, `mesh3d.weather`,
`mesh3d.lightning` (the optional Lightning extra) and `mesh3d.planner`, with its signature and docstring. The guides
explain how the pieces fit: [concepts](concepts.md), [parallelize](parallelize.md), [domain](domain.md),
[checkpoint](checkpoint.md), [data](data.md), [weather](weather.md), [lightning](lightning.md), [plan](plan.md).
"""


def public_names(package: str) -> list[tuple[str, object]]:
    import importlib

    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in module.__all__]


def _signature(name: str, obj: object) -> str:
    target = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
    try:
        sig = str(inspect.signature(target))
    except (TypeError, ValueError):
        return name
    if target is not obj:  # drop self
        sig = sig.replace("(self, ", "(").replace("(self)", "()")
    return f"{name}{sig}"


def _entry(package: str, name: str, obj: object) -> str | None:
    if inspect.ismodule(obj):
        return f"### `{package}.{name}`\n\nSubpackage: see its section below.\n"
    if not (inspect.isclass(obj) or callable(obj)):
        return f"### `{package}.{name}`\n\n`{name} = {obj!r}`\n"
    kind = "class" if inspect.isclass(obj) else "function"
    doc = inspect.getdoc(obj) or "(no docstring)"
    parts = [f"### `{package}.{name}` ({kind})\n", f"```python\n{_signature(name, obj)}\n```\n", doc + "\n"]
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for attr, member in sorted(vars(obj).items()):
            if attr.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if not callable(fn) or not (inspect.getdoc(fn) or "").strip():
                continue
            label = attr if isinstance(member, property) else _signature(attr, fn).replace("(self, ", "(").replace("(self)", "()")
            first = inspect.getdoc(fn).split("\n\n")[0].replace("\n", " ")
            parts.append(f"- `{label}`: {first}")
        parts.append("")
    return "\n".join(parts)


def render() -> str:
    out = [HEADER]
    for package in PACKAGES:
        out.append(f"## `{package}`\n")
        for name, obj in public_names(package):
            entry = _entry(package, name, obj)
            if entry:
                out.append(entry)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the code")
    args = parser.parse_args()
    target = ROOT / "docs" / "api.md"
    text = render()
    if args.check:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is out of date: run python scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
