"""The package's shape: no import circle between its modules, no source file over 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

SRC = Path(__file__).resolve().parents[1] / "src" / "torch_sgn"
MOST_LINES = 800


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (SRC.parent / Path(*name.split(".")) / "__init__.py").exists()


def _exists(name: str) -> bool:
    path = SRC.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _resolve(module: str, node: ast.ImportFrom) -> List[str]:
    """The package's modules that ``from ... import ...`` in ``module`` loads."""
    if node.level:
        base = module.split(".")
        if not _is_package(module):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("torch_sgn"):
        return []
    out = [target] if _exists(target) else []
    for alias in node.names:  # `from . import direct` loads a submodule
        sub = f"{target}.{alias.name}"
        if _exists(sub):
            out.append(sub)
    return out


def _top_level_imports(path: Path, type_only: bool = False) -> Set[str]:
    """Imports that run when the module is imported: at module level, outside ``if
    TYPE_CHECKING:`` blocks (not those inside functions); ``type_only``: those blocks' too."""
    module = _module_name(path)
    found: Set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if type_only or "TYPE_CHECKING" not in test:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.ImportFrom):
                found.update(_resolve(module, node))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("torch_sgn"))

    visit(ast.parse(path.read_text()).body)
    found.discard(module)
    return found


def _graph(type_only: bool = False) -> Dict[str, Set[str]]:
    return {_module_name(p): _top_level_imports(p, type_only) for p in SRC.rglob("*.py")}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _without_packages(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph of modules alone: a package's ``__init__`` re-exports its modules, and
    importing a module runs its package's ``__init__`` first, which is no circle between the
    modules themselves."""
    return {
        m: {t for t in targets if not _is_package(t)}
        for m, targets in graph.items()
        if not _is_package(m)
    }


def test_no_import_circle_between_modules():
    cycles = _cycles(_without_packages(_graph()))
    assert cycles == [], f"import circles: {cycles}"


def test_no_import_circle_through_type_only_imports():
    """A lower layer does not name a higher one, not even for its annotations."""
    cycles = _cycles(_without_packages(_graph(type_only=True)))
    assert cycles == [], f"import circles through `if TYPE_CHECKING:` imports: {cycles}"


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_imports():
    graph = _graph()
    assert "torch_sgn.solve.core" in graph["torch_sgn.stepper"]  # from .solve import core
    assert "torch_sgn.solve.descents" in graph["torch_sgn.solve.step"]


def test_no_source_file_over_800_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert long == {}, f"files over {MOST_LINES} lines: {long}"


def test_one_pinn_step_enters_the_optimizer_once_and_visits_12_files():
    """The walk of one SGN.step on a Residuals problem (scripts/step_walk.py): the optimizer's
    module is entered by the user's call alone (the step's recipe is the Stepper's), and the
    step visits at most 12 of the library's files besides the problem's evaluation."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "step_walk.py"
    spec = importlib.util.spec_from_file_location("step_walk", path)
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    calls = walk.measure()
    files, moves, entries = walk.walk(calls)
    assert entries == 1 and files[:3] == ["optimizer.py", "options.py", "stepper.py"]
    # the walk's files besides the problem's own evaluation (docs/ARCHITECTURE.md names each)
    assert len(walk.walk(calls, walk.EVALUATION)[0]) <= 12
    assert "solve/core.py" in files and moves > len(files)  # the step ran through the core
