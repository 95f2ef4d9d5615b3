"""The source's packages import one way only, bottom to top (``shared/DESIGN.md``'s layers):
the core values, graph analysis, rules and propagation, the cost model, the solver, lowering to
per-rank programs, the runtime, and last the public face and command line. A module may import
its own layer and those below it, at the top of a file or inside a function alike."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (
    ("core", ("autopar.core",)),
    ("analysis", ("autopar.passes.analysis",)),
    ("rules", ("autopar.passes.rules", "autopar.passes.propagation")),
    ("cost", ("autopar.cost_model",)),
    ("solve", ("autopar.passes.solve",)),
    ("lower", ("autopar.passes.lower",)),
    ("runtime", ("autopar.runtime",)),
    ("face", ("autopar",)),
)
"""Layers bottom to top, each by the packages it holds; a module belongs to the layer of its
longest matching package (``autopar`` itself and ``autopar.examples`` are the face)."""

FOLDERS = {
    "autopar": "autopar",
    "passes": "autopar.passes",
    "cost_model": "autopar.cost_model",
    "runtime": "autopar.runtime",
    "examples": "autopar.examples",
}
"""Source folder → the package it installs as (``pyproject.toml``'s ``package-dir``)."""


def layer_of(module: str) -> int:
    best, level = "", None
    for i, (_, packages) in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > len(best):
                best, level = package, i
    return level


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every autopar module the file imports."""
    return [(line, name) for line, name in _all_imports(path) if name == "autopar" or name.startswith("autopar.")]


def test_every_module_belongs_to_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    against = []
    for name, path in modules().items():
        own = layer_of(name)
        for line, target in imports(path):
            if layer_of(target) > own:
                against.append(
                    f"{path.relative_to(ROOT)}:{line}: {name} ({LAYERS[own][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert against == [], "imports against the layers' order:\n" + "\n".join(against)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_each_layer_holds_a_module(layer):
    """A layer with no module left would make the order say less than it seems to."""
    assert any(LAYERS[layer_of(name)][0] == layer for name in modules())


def test_every_declared_dependency_is_imported_by_the_source():
    """A dependency in ``pyproject.toml`` that no source file imports does not earn its place."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    requirements = re.findall(r'"([^"]+)"', block)
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in requirements}
    assert names >= {"torch"}
    imported = {name.split(".")[0] for path in modules().values() for _, name in _all_imports(path)}
    assert names - imported == set()


def _all_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found
