"""Which public names' docstrings leave something out.

    python scripts/check_docstrings.py        # one line per gap; exit status 1 if any

The public names are those the API reference documents: the ``__all__`` of ``torch_sgn``,
``torch_sgn.pinn``, ``torch_sgn.deepxde`` and ``torch_sgn.distributed``, and
``torch_sgn.route_plan.Plan``; with each class, its public methods and properties. Read
statically by griffe (as the site reads them), in Google style. A gap is one of:

* ``args``: a parameter not in the ``Args:`` section (a class's in the class docstring or its
  ``__init__``'s);
* ``annotation``: a parameter without a type annotation (``*args``/``**kwargs`` aside);
* ``returns``: a function with a return annotation other than ``None`` and no ``Returns:``
  (or ``Yields:``) section;
* ``raises``: an exception the function's own body raises by name, not in ``Raises:``;
* ``attributes``: a field of a dataclass or named tuple not in the ``Attributes:`` section;
* ``docstring``: no docstring at all.

tests/test_docs.py compares the gaps with the list in ``scripts/docstring_gaps.txt``: a gap
not in the list fails the test, and so does a line of the list that is no longer a gap.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from docs_hooks import public_names  # noqa: E402

MODULES = ["torch_sgn", "torch_sgn.pinn", "torch_sgn.deepxde", "torch_sgn.distributed"]
EXTRA = ["torch_sgn.route_plan.Plan"]
Kind = griffe.DocstringSectionKind


def _sections(obj) -> dict:
    if obj.docstring is None:
        return {}
    found: dict = {}
    for section in obj.docstring.parse("google", warnings=False):
        found.setdefault(section.kind, []).append(section)
    return found


def _names(sections: dict, kind) -> set:
    names = set()
    for section in sections.get(kind, []):
        for item in section.value:
            name = getattr(item, "name", None) or getattr(item, "annotation", None)
            names.add(str(name).lstrip("*"))
    return names


def _raised(function) -> set:
    """Exception names the function's own body raises (not its nested functions)."""
    node = function.source and ast.parse(_dedent(function.source)).body[0]
    found = set()

    def visit(n) -> None:
        for child in ast.iter_child_nodes(n):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id[:1].isupper():
                    found.add(exc.id)
                elif isinstance(exc, ast.Attribute):
                    found.add(exc.attr)
            visit(child)

    if node is not None:
        visit(node)
    return found


def _dedent(source: str) -> str:
    lines = source.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def _function_gaps(path: str, function, documented: dict, is_init: bool = False) -> list:
    gaps = []
    params = [
        p
        for p in function.parameters
        if p.name not in ("self", "cls") and not (is_init and p.name == "self")
    ]
    args = _names(documented, Kind.parameters)
    missing = [p.name for p in params if p.name not in args]
    if missing:
        gaps.append(f"{path}: args {', '.join(missing)}")
    unannotated = [
        p.name
        for p in params
        if p.annotation is None and p.kind.name not in ("var_positional", "var_keyword")
    ]
    if unannotated:
        gaps.append(f"{path}: annotation {', '.join(unannotated)}")
    returns = function.returns
    if (
        not is_init
        and "property" not in function.labels
        and returns is not None
        and str(returns) not in ("None", "NoReturn")
        and not (documented.get(Kind.returns) or documented.get(Kind.yields))
    ):
        gaps.append(f"{path}: returns")
    undocumented = sorted(_raised(function) - _names(documented, Kind.raises))
    if undocumented:
        gaps.append(f"{path}: raises {', '.join(undocumented)}")
    return gaps


def _is_record(cls) -> bool:
    return "dataclass" in cls.labels or any(str(b).endswith("NamedTuple") for b in cls.bases)


def _class_gaps(path: str, cls) -> list:
    gaps = []
    sections = _sections(cls)
    if _is_record(cls):
        fields = [
            name
            for name, member in cls.members.items()
            if member.is_attribute and not name.startswith("_") and member.annotation is not None
        ]
        missing = [f for f in fields if f not in _names(sections, Kind.attributes)]
        if missing:
            gaps.append(f"{path}: attributes {', '.join(missing)}")
    init = cls.members.get("__init__")
    if init is not None and not init.is_alias and not _is_record(cls):
        documented = dict(sections)
        for kind, found in _sections(init).items():
            documented.setdefault(kind, []).extend(found)
        gaps += _function_gaps(f"{path}.__init__", init, documented, is_init=True)
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias or not member.is_function:
            continue
        gaps += _gaps(f"{path}.{name}", member)
    return gaps


def _gaps(path: str, obj) -> list:
    if obj.docstring is None:
        return [f"{path}: docstring"]
    if obj.is_class:
        return _class_gaps(path, obj)
    if obj.is_function:
        return _function_gaps(path, obj, _sections(obj))
    return []


def _target(obj):
    return obj.final_target if obj.is_alias else obj


def gaps() -> list:
    """Every gap of the public names' docstrings, one line each, sorted."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")])
    package = loader.load("torch_sgn")
    loader.resolve_aliases(implicit=False, external=False)
    found = []
    for module in MODULES:
        target = package if module == "torch_sgn" else package[module.split(".", 1)[1]]
        for name in public_names(module):
            found += _gaps(f"{module}.{name}", _target(target[name]))
    for path in EXTRA:
        found += _gaps(path, _target(package[path.split(".", 1)[1]]))
    return sorted(set(found))


if __name__ == "__main__":
    lines = gaps()
    print("\n".join(lines) if lines else "no gaps")
    sys.exit(1 if lines else 0)
