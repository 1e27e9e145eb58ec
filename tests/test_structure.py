"""The coordinator's shape, checked statically (the code every coming change touches stays easy to live in): no
function in spind/coordinator over 60 lines, and no module reaching into a coordinator class by its private names."""

from __future__ import annotations

import ast
from pathlib import Path

SPIND = Path(__file__).resolve().parent.parent / "spind"
COORDINATOR = SPIND / "coordinator"
MAX_FUNCTION_LINES = 60


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_function_in_the_coordinator_is_over_60_lines():
    long = [f"{p.relative_to(SPIND.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in sorted(COORDINATOR.rglob("*.py")) for n in ast.walk(_parse(p))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def _private_names_of_coordinator_classes() -> dict[str, set[str]]:
    """name -> the classes (in spind/coordinator) whose private methods or `self._x` attributes use it."""
    names: dict[str, set[str]] = {}
    for p in COORDINATOR.rglob("*.py"):
        for cls in [n for n in ast.walk(_parse(p)) if isinstance(n, ast.ClassDef)]:
            for n in ast.walk(cls):
                name = None
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = n.name
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    name = n.attr
                if name and name.startswith("_") and not name.startswith("__"):
                    names.setdefault(name, set()).add(f"{p.stem}.{cls.name}")
    return names


def test_no_module_reaches_into_a_coordinator_class_by_private_names():
    private = _private_names_of_coordinator_classes()
    assert "_complete" in private  # the scan sees the classes (the pipeline's own private method)
    reaches = [f"{p.relative_to(SPIND.parent)}:{n.lineno} {ast.unparse(n)} ({', '.join(sorted(private[n.attr]))})"
               for p in sorted(SPIND.rglob("*.py")) + sorted((SPIND.parent / "tests").glob("*.py"))
               for n in ast.walk(_parse(p))
               if isinstance(n, ast.Attribute) and n.attr in private
               and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
    assert not reaches, reaches
