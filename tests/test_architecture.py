"""Import boundaries of the package, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts, at module level and inside functions (the lazy imports that keep
``--help`` fast run too, just later), and ``importlib.import_module("literal")``; imports under
``if TYPE_CHECKING:`` do not (they never run). ``from a.b import c`` is an import of module
``a.b.c`` when that module exists, else of ``a.b`` (its ``__init__``). Importing a submodule
is not counted as importing its parent packages: every package's ``__init__`` runs first and
usually imports its own submodules, which is how packages work, not a design circle.

* ``pipeline/`` is the pipeline only: it imports nothing from the algorithm above it.
* The pure packages import no Lightning, not even through other modules of the package.
* No import circle, between modules or between subpackages.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "tclightning"

# What pipeline/ must not import: the GRPO algorithm and everything that drives it.
ABOVE_PIPELINE = (
    "tclightning.grpo",
    "tclightning.sampling",
    "tclightning.anchor",
    "tclightning.cli",
    "tclightning.agentic",
    "tclightning.callbacks",
    "tclightning.probes",
    "tclightning.run",
    "tclightning.bench",
)
# Pure logic (tensor math, rules) that anyone can use without Lightning.
PURE = ("tclightning.codecs", "tclightning.anchor", "tclightning.health", "tclightning.grpo.loss",
        "tclightning.weight_sync")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


@dataclass(frozen=True)
class Import:
    """``source`` (a module of the package) imports ``target`` (absolute name) at ``line``."""

    source: str
    target: str
    line: int


def module_name(path: Path, root: Path = REPO) -> str:
    """``tclightning/pipeline/stage.py`` -> ``tclightning.pipeline.stage``; a package's
    ``__init__.py`` -> the package's name."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = REPO, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name."""
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node``, except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _statements(other)
            continue
        yield child
        yield from _statements(child)


def read_imports(source: str, name: str, *, is_package: bool, modules: Iterable[str]) -> list[Import]:
    """The imports of module ``name`` whose code is ``source`` (see the module docstring for
    what counts); relative imports are made absolute, ``from x import y`` resolved against
    ``modules`` (the dotted names that are modules)."""
    known = set(modules)
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []
    for node in _statements(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(Import(name, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                found.append(Import(name, submodule if submodule in known else origin, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(name, node.args[0].value, node.lineno))
    return found


def package_imports(root: Path = REPO, package: str = PACKAGE) -> list[Import]:
    """The imports of every module of ``package``."""
    modules = package_modules(root, package)
    return [
        found
        for name, path in modules.items()
        for found in read_imports(path.read_text(), name, is_package=path.name == "__init__.py", modules=modules)
    ]


def inside(target: str, prefixes: Iterable[str]) -> bool:
    """``target`` is one of ``prefixes`` or a module under one."""
    return any(target == prefix or target.startswith(prefix + ".") for prefix in prefixes)


def module_graph(imports: Iterable[Import], modules: Iterable[str]) -> dict[str, dict[str, int]]:
    """``source -> {imported module of the package: first line}``; an import of a name that is
    not a module (``from a.b import func``) is an edge to the nearest enclosing module."""
    known = set(modules)
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    for found in imports:
        target = found.target
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != found.source:
            graph[found.source].setdefault(target, found.line)
    return graph


def unit(module: str) -> str:
    """The subpackage (or top-level module) of the package that ``module`` belongs to."""
    return ".".join(module.split(".")[:2])


def unit_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """Subpackage -> {subpackage it imports: one ``module:line -> module`` import that does it}."""
    units: dict[str, dict[str, str]] = {unit(name): {} for name in graph}
    for source, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if unit(source) != unit(target):
                units[unit(source)].setdefault(unit(target), f"{source}:{line} -> {target}")
    return units


def cycles(graph: dict[str, dict[str, object]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, dict[str, object]]) -> str:
    """The edges inside one circle, one per line, for a failure message."""
    members = set(component)
    return "\n".join(
        f"  {source} -> {target} ({where})"
        for source in component
        for target, where in sorted(graph[source].items())
        if target in members
    )


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return package_imports()


@pytest.fixture(scope="module")
def graph(imports: list[Import]) -> dict[str, dict[str, int]]:
    return module_graph(imports, package_modules())


def test_the_reader_counts_lazy_imports_and_skips_type_checking() -> None:
    source = """
from typing import TYPE_CHECKING
import torch
from . import sibling
from ..codecs import make_codec
if TYPE_CHECKING:
    from tclightning.grpo import GRPOModule
else:
    import json

def build():
    from tclightning.cli.bench import main_link
    importlib.import_module("tclightning.bench.link")
"""
    modules = {"tclightning.pipeline.sibling", "tclightning.codecs", "tclightning.cli.bench"}
    found = read_imports(source, "tclightning.pipeline.stage", is_package=False, modules=modules)
    assert [(f.target, f.line) for f in found] == [
        ("typing", 2),
        ("torch", 3),
        ("tclightning.pipeline.sibling", 4),
        ("tclightning.codecs", 5),
        ("json", 9),
        ("tclightning.cli.bench", 12),
        ("tclightning.bench.link", 13),
    ]


def test_the_cycle_finder_reports_every_circle() -> None:
    graph: dict[str, dict[str, object]] = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"d": 1, "a": 1}, "e": {}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"x": {"y": 1}, "y": {"x": 1}, "z": {"w": 1}, "w": {"z": 1}}) == [["w", "z"], ["x", "y"]]


def test_the_package_graph_is_read(graph: dict[str, dict[str, int]]) -> None:
    """The reader sees the package's real edges, a function-level one included (not vacuous)."""
    assert "tclightning.codecs.prf" in graph["tclightning.bench.codec"]  # module level
    assert "tclightning.cli.bench" in graph["tclightning.cli.main"]  # inside build_parser
    assert "tclightning.bench.link" in graph["tclightning.cli.bench"]  # inside a handler


def test_pipeline_imports_nothing_from_the_algorithm(imports: list[Import]) -> None:
    """``pipeline/`` moves tensors between stages; the GRPO update, the samplers, the anchor and
    the command line use it, never the other way round (a loss is passed in as a function)."""
    bad = sorted({f for f in imports if inside(f.source, ["tclightning.pipeline"]) and inside(f.target, ABOVE_PIPELINE)},
                 key=lambda f: (f.source, f.line, f.target))
    assert not bad, "pipeline/ imports code above it:\n" + "\n".join(
        f"  {f.source}:{f.line} imports {f.target}" for f in bad
    )


def test_pure_packages_import_no_lightning(imports: list[Import], graph: dict[str, dict[str, int]]) -> None:
    """Neither a pure module nor any module of the package it imports (at any depth) imports
    Lightning, so the math is usable and testable without it."""
    chains: dict[str, list[str]] = {}
    todo = sorted(name for name in graph if inside(name, PURE))
    for name in todo:
        chains[name] = [name]
    while todo:
        name = todo.pop()
        for target in sorted(graph[name]):
            if target not in chains:
                chains[target] = [*chains[name], target]
                todo.append(target)
    bad = sorted({f for f in imports if f.source in chains and inside(f.target, LIGHTNING)},
                 key=lambda f: (f.source, f.line, f.target))
    assert not bad, "a pure module needs Lightning:\n" + "\n".join(
        f"  {' -> '.join(chains[f.source])} ({f.source}:{f.line} imports {f.target})" for f in bad
    )


def test_no_import_circle_between_modules(graph: dict[str, dict[str, int]]) -> None:
    found = cycles(graph)
    assert not found, "import circles between modules (source -> target (line)):\n" + "\n".join(
        describe(component, graph) for component in found
    )


def test_no_import_circle_between_subpackages(graph: dict[str, dict[str, int]]) -> None:
    """Subpackages form layers: if ``a/`` imports ``b/``, nothing in ``b/`` imports ``a/``."""
    units = unit_graph(graph)
    found = cycles(units)
    assert not found, "import circles between subpackages (one import per edge):\n" + "\n".join(
        describe(component, units) for component in found
    )


def test_every_source_compiles_without_a_warning() -> None:
    """An invalid escape in a string (``"\\|"``) is a SyntaxWarning from Python 3.12 on, printed
    to every user at import, and an error in a later Python."""
    import warnings

    for path in sorted(p for root in ("tclightning", "tests", "benchmarks", "tools") for p in (REPO / root).rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
