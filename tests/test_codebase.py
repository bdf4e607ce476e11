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
    """Function-level imports hide cycles; only optional dependencies, and torch's own modules deferred for their import
    time (mesh3d._torch_private: Dynamo's Python half, DTensor), may be imported late, with a noqa saying why."""
    late = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for lineno, text in _runtime_imports(module)[1]:
            targets = _imported(module, ast.parse(text).body[0])  # type: ignore[arg-type]
            if any((module, t) in ALLOWED_FUNCTION_IMPORTS for t in targets):
                continue
            if "noqa: PLC0415" in lines[lineno - 1] and "optional" in lines[lineno - 1]:
                continue
            if "noqa: PLC0415" in lines[lineno - 1] and "deferred" in lines[lineno - 1] and not targets:
                continue  # NOTE: no mesh3d module: no cycle to hide
            late.append(f"{path.relative_to(ROOT)}:{lineno}: {text}")
    assert late == []


def test_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


#: The layers of ``mesh3d.domain``, lowest first: a module imports only from its own layer and those below
#: (docs/architecture.md). Modules directly under ``mesh3d/domain/`` (the public face) stand above every layer.
DOMAIN_LAYERS = ("core", "comm", "halo", "layouts", "dispatch", "attention", "ops")


def _domain_layer(module: str) -> int:
    parts = module.split(".")
    if parts[:2] != ["mesh3d", "domain"] or len(parts) < 3:
        return len(DOMAIN_LAYERS)
    return DOMAIN_LAYERS.index(parts[2]) if parts[2] in DOMAIN_LAYERS else len(DOMAIN_LAYERS)


def _upward_domain_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("mesh3d.domain.")
                  for t in targets if t.startswith("mesh3d.domain.") and _domain_layer(t) > _domain_layer(m))


def test_the_layer_check_sees_an_upward_import():
    graph = {"mesh3d.domain.core.tensor": {"mesh3d.domain.dispatch.registry"},
             "mesh3d.domain.ops.conv": {"mesh3d.domain.core.tensor"}}
    assert _upward_domain_imports(graph) == ["mesh3d.domain.core.tensor -> mesh3d.domain.dispatch.registry"]


def test_domain_layers_import_only_downward():
    """Each sub-package of mesh3d.domain is a layer (``DOMAIN_LAYERS``); no module imports from a layer above its own,
    and every sub-package says in its docstring what it holds."""
    graph = _graph()
    assert any(t.startswith("mesh3d.domain.core.") for t in graph["mesh3d.domain.dispatch.dispatcher"])  # real edges
    assert _upward_domain_imports(graph) == []
    folders = sorted(p.name for p in (PACKAGE / "domain").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(DOMAIN_LAYERS)
    for layer in DOMAIN_LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / "domain" / layer / "__init__.py").read_text()))
        assert doc and doc.endswith("."), layer


#: Private torch names: a dotted path from ``torch`` with a part that starts with one underscore.
_PRIVATE_TORCH = re.compile(r"\btorch(?:\.[A-Za-z0-9]\w*)*\._[a-z]\w*")


def _private_torch_uses(path: Path) -> list[str]:
    """Imports and attribute chains of private torch names in ``path`` (code only: docstrings and comments aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _PRIVATE_TORCH.search(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.startswith("torch"):
            found += [n for a in node.names if _PRIVATE_TORCH.search(n := f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            if _PRIVATE_TORCH.fullmatch(text):
                found.append(text)
    return sorted(set(found))


def test_the_private_torch_check_finds_private_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nfrom torch.utils._pytree import tree_map\nfrom torch.distributed.tensor import DTensor\n"
                      "x = torch._ops.OpOverload\ny = torch.ops.aten._foo.default\nz = 'torch._in_a_string'\n")
    assert _private_torch_uses(sample) == ["torch._ops", "torch.ops.aten._foo", "torch.utils._pytree.tree_map"]


def test_private_torch_apis_only_in_torch_private():
    """Every private torch name mesh3d uses sits in ``mesh3d/_torch_private/`` (each with why no public API serves)."""
    uses = {str(p.relative_to(ROOT)): u for p in sorted(PACKAGE.rglob("*.py"))
            if "_torch_private" not in p.parts and (u := _private_torch_uses(p))}
    assert uses == {}
    assert _private_torch_uses(PACKAGE / "_torch_private" / "kernels.py")  # the check reads real code


#: torch.distributed's calls that move data between ranks (collectives and point-to-point)
_TALKING = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
            "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
            "gather_object", "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
            "batch_isend_irecv", "P2POp"}


def _talking_calls(path: Path) -> list[str]:
    """The calls (and ``P2POp`` names) of torch.distributed's data-moving functions in ``path``: ``dist.x``, and
    ``torch.distributed.x`` or ``torch.distributed._functional_collectives.x`` spelled out."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in _TALKING:
            base = ast.unparse(node.value)
            if base in ("dist", "torch.distributed", "funcol") or base.startswith("torch.distributed."):
                found.append(f"{base}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in _TALKING]
    return sorted(set(found))


def test_the_talking_check_finds_collectives(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed as dist\nfrom torch.distributed import all_reduce\n"
                      "dist.broadcast(t, 0)\nops = [dist.P2POp(dist.isend, t, 1)]\nx = dist.get_rank()\n")
    assert _talking_calls(sample) == ["dist.P2POp", "dist.broadcast", "dist.isend", "torch.distributed.all_reduce"]


def test_one_module_of_the_domain_posts_messages():
    """Issue 66: every message between domain ranks is posted by ``comm/stopping.py`` (the checked point-to-point
    transport's one post); rules, layouts and the API reach other ranks through the executor and ``comm``."""
    talking = {str(p.relative_to(ROOT)): c for p in sorted((PACKAGE / "domain").rglob("*.py")) if (c := _talking_calls(p))}
    assert set(talking) == {"mesh3d/domain/comm/stopping.py"}, talking


#: The helpers of ``mesh3d.domain.comm`` that move data between ranks (forward, or backward: ``sum_grad``)
_COMMUNICATING = {"mesh3d.domain.comm.collectives": {"all_parts", "all_reduce_max", "all_reduce_sum",
                                                     "reduce_for_local_use", "reduce_to_replicated", "sum_grad"},
                  "mesh3d.domain.comm.exchange": {"exchange_all", "exchange_point", "gather_rows", "start_exchange",
                                                  "run_exchange", "swap", "report_failure", "PendingExchange"}}
def _communicating_imports(path: Path) -> list[str]:
    """The communicating helpers of ``mesh3d.domain.comm`` that ``path`` imports (``_COMMUNICATING``)."""
    return sorted(a.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                  for a in node.names if a.name in _COMMUNICATING.get(node.module or "", set()))


def test_the_communicating_helpers_check_reads_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from mesh3d.domain.comm.collectives import sum_dtype, sum_grad\n"
                      "from mesh3d.domain.comm.exchange import gather_rows as g\n")
    assert _communicating_imports(sample) == ["gather_rows", "sum_grad"]


def test_no_rule_module_calls_a_communicating_helper():
    """Issue 66: rules declare, the executor talks. No rule module under ``mesh3d/domain/ops`` imports a helper of
    ``mesh3d.domain.comm`` that moves data between ranks: rows, whole operands, partial results and statistics are a
    step's requirements (``step.Rows``, ``Entering``, ``Partial``, ``Combining``, ...), resolved by the executor (17
    modules did on 2026-12-07)."""
    calling = {str(p.relative_to(ROOT)): names for p in sorted((PACKAGE / "domain" / "ops").rglob("*.py"))
               if (names := _communicating_imports(p))}
    assert calling == {}, calling


def test_no_module_imports_another_modules_private_name():
    crossing = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mesh3d")):
                crossing += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert crossing == []


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
        return (result, shared, str(err), type(cause).__name__ if cause else None, cleaned,
                getattr(err, "__notes__", []), {r: "fail_on_odd_ranks" in t for r, t in err.rank_tracebacks.items()})
    return None


def test_collective_step_raises_the_same_error_everywhere_chained_to_the_local_one(ranks):
    outcomes = ranks.run(4, _collective_step_outcomes)
    for rank, (result, shared, message, cause, cleaned, notes, frames) in enumerate(outcomes):
        assert result == rank * 10
        assert shared == [{"r": 0}, {"r": 10}, {"r": 20}, {"r": 30}]
        # one line per cause, the same on every rank; no rank's traceback in the message or its notes
        assert message == ("phase two failed on 2 of 4 ranks. Nothing was written\n"
                           "  rank 1: OSError: disk 1 full\n"
                           "  rank 3: OSError: disk 3 full")
        assert cause == ("OSError" if rank % 2 else None)  # chained to this rank's own failure, if it had one
        assert cleaned == [1]
        assert notes == [] and frames == {1: True, 3: True}   # the tracebacks, kept aside
