"""The package's layout is its architecture: imports point down the layers, never up or in a circle, and every
module says what it owns. These tests read the source (no imports), so they are fast and catch a new arrow the
moment it is written."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Lowest first. A module may import from its own layer and any layer below it, never above.
LAYERS = ["numerics", "options", "store", "recording", "training", "integrations", "sandbox", "analysis", "dashboard", "entry"]


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "mpdiag" or len(parts) == 1:
        return "entry"  # app.py, pages/, mpdiag/__init__.py
    if parts[1] in LAYERS:
        return parts[1]
    return "entry"  # mpdiag.cli, mpdiag.__main__, mpdiag.examples


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "mpdiag").rglob("*.py"), ROOT / "app.py", *(ROOT / "pages").glob("*.py")]
    modules = {}
    for path in files:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(path: Path) -> set[str]:
    """The mpdiag modules ``path`` imports, at any depth in the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpdiag"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("mpdiag"))
    return found


MODULES = _sources()
ARROWS = {(m, t) for m, p in MODULES.items() for t in _imports(p) if t in MODULES and t != m and not m.startswith(t + ".")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("mpdiag.")))
def test_imports_point_down_the_layers(module):
    mine = LAYERS.index(_layer(module))
    upward = [t for m, t in ARROWS if m == module and _layer(t) != "entry" and LAYERS.index(_layer(t)) > mine]
    assert not upward, f"{module} ({_layer(module)}) imports from a higher layer: {upward}"


def test_every_import_names_a_module_that_exists():
    """An import of a moved or renamed module fails only when its line runs (a lazy import, a page), so the
    source is checked: every ``from mpdiag.x import y`` names a module x of the package."""
    missing = sorted({(m, node.module) for m, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpdiag")
                      and node.module not in MODULES})
    assert not missing, missing


def test_no_import_circles():
    graph: dict[str, set[str]] = {}
    for a, b in ARROWS:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(nxt):] + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_owns(module):
    docstring = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert docstring and len(docstring.split()) >= 8, f"{module} needs a docstring saying what it owns"


def test_no_text_points_to_a_document_that_does_not_ship():
    """Messages, docstrings and comments explain themselves or point into the README or docs/ (the reference, whose
    pages tests/test_docs.py checks exist), never to files outside them."""
    shipped = [*(ROOT / "mpdiag").rglob("*.py"), ROOT / "app.py", *(ROOT / "pages").glob("*.py"), ROOT / "README.md",
               *(ROOT / "docs").rglob("*.md")]
    offenders = [str(path.relative_to(ROOT)) for path in shipped
                 if any(phrase in path.read_text() for phrase in ("reference section", "shared/reference", "reference §"))]
    assert not offenders
