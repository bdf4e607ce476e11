"""The package's shape: no import cycles, imports at the top, modules under 400 lines, and a
docs/architecture.md that names only modules that exist. Static (ast over mesh3d/), no ranks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mesh3d"

#: Function-level imports that stay, each for a reason the import cannot be at the top.
ALLOWED_FUNCTION_IMPORTS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The mesh3d modules ``node`` loads (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs or ([base] if base in MODULES else [])


def _runtime_imports(module: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(mesh3d modules imported when ``module`` runs, function-level imports as (line, text))."""
    tree = ast.parse(MODULES[module].read_text())
    edges: set[str] = set()
    in_functions: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            return  # annotations only: not run
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges.update(_imported(module, node))
            if in_function:
                in_functions.append((node.lineno, ast.unparse(node)))
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    edges.discard(module)
    return edges, in_functions


def _graph() -> dict[str, set[str]]:
    """Every module's imports; the allowed late imports are left out (they are the known exceptions)."""
    return {m: {t for t in _runtime_imports(m)[0] if (m, t) not in ALLOWED_FUNCTION_IMPORTS} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """Edges are the imports a module runs, at the top or in a function (TYPE_CHECKING blocks
    excluded); a package's own __init__ running before its submodules is Python's doing, not an edge."""
    graph = _graph()
    assert "mesh3d.parallel.validate" in graph["mesh3d.parallel.explain"]  # the graph sees real edges
    assert _cycles(graph) == []


def test_imports_are_at_the_top():
    """Function-level imports hide cycles; only optional dependencies (with a noqa saying why) may be imported late."""
    late = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for lineno, text in _runtime_imports(module)[1]:
            targets = _imported(module, ast.parse(text).body[0])  # type: ignore[arg-type]
            if any((module, t) in ALLOWED_FUNCTION_IMPORTS for t in targets):
                continue
            if "noqa: PLC0415" in lines[lineno - 1] and "optional" in lines[lineno - 1]:
                continue
            late.append(f"{path.relative_to(ROOT)}:{lineno}: {text}")
    assert late == []


def test_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_architecture_map_names_only_modules_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\bmesh3d(?:/[A-Za-z_][A-Za-z0-9_]*)+(?:\.py|/)?", text))
    assert len(named) >= 20  # the map names the modules of every package
    missing = []
    for name in sorted(named):
        path = ROOT / name
        if not (path.exists() or path.with_suffix(".py").exists()):
            missing.append(name)
    assert missing == []
    for package in ("parallel", "domain", "checkpoint", "data", "lightning"):
        assert f"mesh3d/{package}/" in text


def _splits_are_owned_by_the_manager():
    import torch
    import torch.distributed as dist

    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(batch=4)
    split = dm.batch_domain_split(2)
    again = dm.batch_domain_split(2)
    ddp = dm.batch_domain_split(1)
    shapes = (tuple(split.shape), tuple(ddp.shape))
    t = torch.ones(1)
    dist.all_reduce(t, group=split.get_group(1))  # a live group: 2 ranks per shard group
    DistributedManager.shutdown()
    cleared = dm._batch_domain_splits == {}
    fresh = DistributedManager.initialize(batch=4)
    remade = fresh.batch_domain_split(2)
    u = torch.ones(1)
    dist.all_reduce(u, group=remade.get_group(1))  # the new manager's groups work after the old ones were destroyed
    return again is split, remade is not split, shapes, cleared, t.item(), u.item()


def test_mesh_splits_live_on_the_manager_and_go_with_shutdown(ranks):
    for result in ranks.run(4, _splits_are_owned_by_the_manager):
        assert result == (True, True, ((2, 2), (4, 1)), True, 2.0, 2.0)


def _collective_step_outcomes():
    import torch.distributed as dist

    from mesh3d.checkpoint.comm import collective_step
    from mesh3d.checkpoint.errors import CheckpointError

    rank = dist.get_rank()
    result, shared = collective_step("phase one", lambda: rank * 10, share=lambda r: {"r": r})
    cleaned = []

    def fail_on_odd_ranks() -> int:
        if rank % 2:
            raise OSError(f"disk {rank} full")
        return rank

    try:
        collective_step("phase two", fail_on_odd_ranks, note="Nothing was written", on_failure=lambda: cleaned.append(1))
    except CheckpointError as err:
        cause = err.__cause__
        notes = getattr(err, "__notes__", [])
        return (result, shared, str(err), type(cause).__name__ if cause else None, cleaned,
                [n.splitlines()[0] for n in notes], any("fail_on_odd_ranks" in n for n in notes))
    return None


def test_collective_step_raises_the_same_error_everywhere_chained_to_the_local_one(ranks):
    outcomes = ranks.run(4, _collective_step_outcomes)
    for rank, (result, shared, message, cause, cleaned, note_heads, has_frames) in enumerate(outcomes):
        assert result == rank * 10
        assert shared == [{"r": 0}, {"r": 10}, {"r": 20}, {"r": 30}]
        assert message == ("phase two failed: rank 1: OSError: disk 1 full; rank 3: OSError: disk 3 full. "
                           "Nothing was written")
        assert cause == ("OSError" if rank % 2 else None)  # chained to this rank's own failure, if it had one
        assert cleaned == [1]
        assert note_heads == ["--- rank 1 ---", "--- rank 3 ---"] and has_frames
