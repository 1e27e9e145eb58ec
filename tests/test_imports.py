"""spind's modules import without circles and without side effects.

- The import graph of every module of spind, spind.kernels and spind.dashboard, read statically (`ast`): module-level
  and function-level imports alike (a function-level import only defers a circle), `if TYPE_CHECKING:` blocks
  left out (they never run). It must have no cycle: a piece two modules share lives in a module both import.
- Every module imports, in a fresh interpreter (optional extras missing: skipped, named).
- Importing spind (the client library, the front ends) changes no environment variable; the CLI entry sets
  OMP_WAIT_POLICY before anything imports torch.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spind": ROOT / "spind", "spind.kernels": ROOT / "kernels", "spind.dashboard": ROOT / "dashboard"}
# imported only where their extra is installed: a module that needs a missing one is skipped, not failed
OPTIONAL = {"streamlit", "altair", "matplotlib", "llama_cpp", "triton", "selenium", "openai", "accelerate"}
# scripts, not modules: importing one runs it
SCRIPTS = {"spind.dashboard.app"}  # the Streamlit page (`spind dashboard` runs it)


def find_modules() -> dict[str, Path]:
    """module name -> file, for every .py under the packages (a package is its __init__.py)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its source (outside `if TYPE_CHECKING:`)."""
    found: set[str] = set()

    def target(name: str) -> str | None:  # `import a.b.c` where a.b.c is an attribute: the longest module prefix
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(filter(None, (target(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                sub = f"{base}.{alias.name}"
                found.update(filter(None, [sub if sub in modules else target(base)]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = find_modules()
    names = set(modules)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", names) for m, p in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle [a, b, ..., a] per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:  # the shortest way from its first module back to itself, inside the component
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def test_the_graph_reader_sees_every_kind_of_import():
    source = textwrap.dedent("""
        import os
        import pkg.a
        from pkg import b
        from pkg.c import name
        from . import d
        from .e import thing
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg import hidden
        else:
            import pkg.f
        def later():
            import pkg.g.attribute
    """)
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f", "pkg.g", "pkg.hidden", "pkg.mod"}
    assert imports_of(source, "pkg.mod", False, modules) == {"pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f",
                                                             "pkg.g"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"spind.cli", "spind.kernels.attention", "spind.dashboard.app"} <= set(graph)  # all three packages read
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


_IMPORT_ALL = """
import importlib, json, os, sys, traceback
failed, skipped = {}, {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] in OPTIONAL:
            skipped[name] = e.name
        else:
            failed[name] = traceback.format_exc()
    except Exception:
        failed[name] = traceback.format_exc()
print(json.dumps({"failed": failed, "skipped": skipped, "omp": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(set(find_modules()) - SCRIPTS)
    code = f"OPTIONAL = {sorted(OPTIONAL)!r}\n{_IMPORT_ALL}"
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300,
                         env=_clean_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["failed"], "\n".join(f"{m}:\n{tb}" for m, tb in result["failed"].items())
    if result["skipped"]:
        print("skipped (optional dependency missing):", result["skipped"])
    assert result["omp"] is None  # importing every module sets no OMP_WAIT_POLICY


def _run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**_clean_env(), **env}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip()


def test_importing_spind_changes_no_environment():
    code = """
        import os, pkgutil, importlib
        before = dict(os.environ)
        import spind, spind.client, spind.protocol, spind.config, spind.frontend
        for m in pkgutil.iter_modules(spind.frontend.__path__):
            importlib.import_module("spind.frontend." + m.name)
        print(sorted(set(os.environ.items()) ^ set(before.items())), "OMP_WAIT_POLICY" in os.environ)
    """
    assert _run(code) == "[] False"


def test_the_cli_sets_omp_wait_policy_before_torch_loads():
    code = """
        import os, sys
        import spind.cli  # what `python -m spind.cli` and the `spind` script import before main runs
        loaded = "torch" in sys.modules
        try:
            spind.cli.main(["--help"])
        except SystemExit:
            pass
        print(loaded, os.environ.get("OMP_WAIT_POLICY"))
    """
    assert _run(code).splitlines()[-1] == "False PASSIVE"
    assert _run(code, OMP_WAIT_POLICY="ACTIVE").splitlines()[-1] == "False ACTIVE"  # the user's own setting wins


def test_the_cli_parser_and_light_commands_import_no_torch():
    """Building `spind`'s parser, and what runs before a command's first line, import no torch (~1.5 s): a parser
    default read from the trainer's module once kept every command, `spind --help` and `spind status` included,
    silent that long, and a cached `spind generate` silent past 2 s before its first line."""
    code = textwrap.dedent("""
        import sys
        from spind.cli import build_parser
        build_parser()
        import spind.coordinator.transport.local, spind.drafter_table, spind.models.loader, spind.tokenizer
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_checkout_root_does_not_hide_pypis_kernels_package(tmp_path):
    """Run from the checkout (the repository root on sys.path, as `python -m pytest` puts it), the top-level
    kernels/ folder is importable as `kernels`, the import name of PyPI's hub kernels that transformers >= 5.25
    imports with every model: where that package is installed, `import kernels` gets it; where it is not, the folder
    (an empty package, as before). spind's own kernels stay `spind.kernels` either way."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    probe = "import kernels, spind.kernels; print(kernels.__file__); print(spind.kernels.__file__)"

    def imported(pythonpath: Path) -> list[Path]:
        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout
        return [Path(line).resolve() for line in out.split()]

    ours = ROOT / "kernels" / "__init__.py"
    assert imported(tmp_path / "site") == [fake / "__init__.py", ours]
    installed = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT])  # PyPI's, in this environment
    got, own = imported(tmp_path / "nothing")
    assert own == ours and (got != ours if installed is not None else got == ours)
