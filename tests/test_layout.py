"""The package's layout: a library on top, the kernels below it, the distributed parts, the
chapters' helpers and the harness beside it; imports point one way, and ``import
tridiag_tutorial`` loads the library alone.

The import graph is read from the source (``ast``): an edge for every ``import`` of a package
module, at module level (what runs on import) or inside a function (what runs later)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import tridiag_tutorial

ROOT = Path(tridiag_tutorial.__file__).parent
PACKAGE = "tridiag_tutorial"
BESIDE = ("book", "bench")  # what the library never imports
SOLVER_API = {"tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve",
              "TridiagonalFactors", "SingularMatrixError", "cpp_available", "to_dense",
              "tridiag_matmul"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str, path: Path):
    """``(imported module, at module level)`` for each import of a package module."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    known = modules()

    def resolve(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name.startswith(PACKAGE)]
        if node.level:
            stem = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        if not stem.startswith(PACKAGE):
            return []
        # "from . import x" names a module x where there is one; else the names come from stem
        subs = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in known]
        return subs or [stem]

    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in resolve(child):
                    yield target, top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)

    yield from walk(tree, True)


def graph(module_level_only: bool) -> dict:
    edges = {}
    for name, path in modules().items():
        targets = {t for t, top in imports(name, path) if top or not module_level_only}
        edges[name] = sorted(t for t in targets if t != name and t != PACKAGE)
    return edges


def find_cycle(edges: dict):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in edges:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def layer(name: str) -> str:
    """library, kernels, distributed, book or bench; base: the checks and errors, and the built
    extension, which every layer may use."""
    if name in (f"{PACKAGE}._validation", f"{PACKAGE}._C"):
        return "base"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BESIDE + ("distributed", "kernels") else "library"


def test_the_module_level_imports_have_no_cycle():
    assert find_cycle(graph(module_level_only=True)) is None


def test_the_library_never_imports_the_book_or_the_harness():
    for name, targets in graph(module_level_only=False).items():
        if layer(name) in ("library", "kernels", "distributed"):
            assert not [t for t in targets if layer(t) in BESIDE], name


def test_the_kernels_import_nothing_above_them():
    """The kernels know validation, the built extension and each other, nothing of the op."""
    for name, targets in graph(module_level_only=False).items():
        if layer(name) == "kernels":
            above = [t for t in targets if layer(t) not in ("kernels", "base")]
            assert not above, (name, above)


def test_the_library_reaches_distributed_only_for_dtensor_rules():
    """One import from the library into the distributed package, made when a DTensor first
    reaches an op (functions._register_sharding_for), of the module that holds the rules."""
    into = {(name, t) for name, targets in graph(module_level_only=False).items()
            if layer(name) in ("library", "kernels") for t in targets if layer(t) == "distributed"}
    assert into == {(f"{PACKAGE}.functions", f"{PACKAGE}.distributed.sharding")}


def test_the_layers_point_one_way():
    """Between the layers (library, kernels, distributed, book, harness), counting every import,
    lazy ones too, but for the DTensor rules' one: no cycle."""
    edges = {}
    for name, targets in graph(module_level_only=False).items():
        for t in targets:
            if layer(t) != layer(name) and (name, t) != (f"{PACKAGE}.functions",
                                                          f"{PACKAGE}.distributed.sharding"):
                edges.setdefault(layer(name), set()).add(layer(t))
    assert find_cycle({k: sorted(v) for k, v in edges.items()}) is None, edges
    assert edges["kernels"] == {"base"}
    assert not edges.get("library", set()) & {"book", "bench", "distributed"}


def test_import_loads_the_library_alone():
    script = ("import sys, json, tridiag_tutorial as t; "
              "print(json.dumps([sorted(m for m in sys.modules if m.startswith('tridiag_tutorial')), "
              "'torch.distributed.tensor' in sys.modules, sorted(t.__all__)]))")
    loaded, dtensor, exported = json.loads(subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert not [m for m in loaded if layer(m) in BESIDE + ("distributed",)], loaded
    assert f"{PACKAGE}.api" in loaded and f"{PACKAGE}.registration" in loaded
    assert set(exported) == SOLVER_API
    del dtensor  # (torch may import DTensor itself; the package does not need to)
