"""The package's shape (docs/design.md section 1): one subpackage per layer, every
import pointing down, no import circle anywhere.

The imports are read with ``ast`` (nothing is imported, so no side effect
can hide or add an arrow), at module level and inside functions alike: an
import inside a function is still an arrow. ``check`` is run on mpicube
itself and, to show that it can fail, on small planted packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module may import its own layer and the layers below it.
LAYERS = ["core", "device", "ops", "parallel", "model", "files", "check", "training", "analysis", "cli"]
MAX_TOP_LEVEL = 10          # entries of mpicube/ besides __init__.py and __main__.py
MAX_LINES = 450


def module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_imports(package_dir: Path) -> dict:
    """{module: {imported module, ...}} for every module of the package, with
    relative imports resolved and ``from X import name`` read as the module
    X.name where that is a module, else as X."""
    paths = {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    top = package_dir.name
    graph = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == top)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != top:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in paths else target)
        found.discard(name)
        graph[name] = {m for m in found if m in paths or m.rpartition(".")[0] in paths}
    return graph


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan),
    each sorted; a module importing itself is not counted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
            visit(v)
    return found


def layer_of(module: str, layers: list) -> int:
    """The layer index of ``module``: -1 for the package root (it imports
    nothing, so anyone may read its ``__version__``), len(layers) for
    ``__main__``; None for a module outside the table."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    if parts[1] == "__main__":
        return len(layers)
    return layers.index(parts[1]) if parts[1] in layers else None


def check(package_dir: Path, layers: list) -> list:
    """Every violation of the layering, one line each."""
    graph = read_imports(package_dir)
    problems = [f"import circle: {' <-> '.join(c)}" for c in circles(graph)]
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            problems.append(f"{module} is in no layer of the table {layers}")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > mine:
                problems.append(f"{module} ({layers[mine]}) imports {target} ({layers[theirs]}), a higher layer")
    return problems


def test_every_import_points_down_and_none_circles():
    problems = check(ROOT / "mpicube", LAYERS)
    assert problems == [], "\n".join(problems)


def test_top_level_is_the_layers_and_every_layer_says_what_it_may_import():
    package = ROOT / "mpicube"
    # (a folder left holding only __pycache__ by an older checkout is not an entry)
    entries = sorted(p.name for p in package.iterdir()
                     if p.name not in ("__init__.py", "__main__.py") and (p.suffix == ".py" or any(p.rglob("*.py"))))
    assert len(entries) <= MAX_TOP_LEVEL, entries
    assert entries == sorted(LAYERS), entries
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((package / layer / "__init__.py").read_text()))
        assert doc and "May import:" in doc, f"mpicube/{layer}/__init__.py: no docstring naming what it may import"


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "mpicube").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, long


# --------------------------------------------------------------------------- the checker fails when it should


def plant(tmp_path: Path, files: dict) -> Path:
    package = tmp_path / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return package


def test_a_planted_circle_fails(tmp_path):
    package = plant(tmp_path, {
        "low/a.py": "from . import b\n",
        "low/b.py": "def f():\n    from .a import x   # inside a function: still an arrow\n",
    })
    assert check(package, ["low"]) == ["import circle: pkg.low.a <-> pkg.low.b"]


def test_a_planted_upward_import_fails(tmp_path):
    package = plant(tmp_path, {
        "low/a.py": "import pkg.high.b\n",
        "high/b.py": "from ..low.a import y\n",
    })
    assert check(package, ["low", "high"]) == [
        "import circle: pkg.high.b <-> pkg.low.a",
        "pkg.low.a (low) imports pkg.high.b (high), a higher layer",
    ]


def test_a_module_outside_the_table_fails(tmp_path):
    package = plant(tmp_path, {"low/a.py": "", "stray/c.py": "from ..low import a\n"})
    assert check(package, ["low"]) == ["pkg.stray is in no layer of the table ['low']",
                                       "pkg.stray.c is in no layer of the table ['low']"]


@pytest.mark.parametrize("source, expected", [
    ("from . import a\n", {"pkg.low.a"}),                     # a module by name
    ("from .a import name\n", {"pkg.low.a"}),                 # a name from a module
    ("from .. import low\n", {"pkg.low"}),                    # a package face
    ("import pkg.low.a as alias\n", {"pkg.low.a"}),
    ("import os\nfrom json import dumps\n", set()),           # not of the package
])
def test_imports_are_resolved(tmp_path, source, expected):
    package = plant(tmp_path, {"low/a.py": "", "low/b.py": source})
    assert read_imports(package)["pkg.low.b"] == expected


def _definitions(path: Path) -> set:
    """Qualified names defined in a module: functions and classes, and
    ``Class.method`` for their methods (nested once)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return names


def test_adding_an_axis_cites_code_that_exists():
    """docs/adding-an-axis.md ties each step of an axis to `path` ·
    `function` (or `Class.method`); a refactor that renames or moves one
    must update the page. Every other file path it names must exist too."""
    import re

    text = (ROOT / "docs" / "adding-an-axis.md").read_text()
    cites = re.findall(r"`([\w/.-]+\.py)`\s*·\s*`([\w.]+)`", text)
    assert len(cites) >= 30, len(cites)
    for path, name in cites:
        assert (ROOT / path).is_file(), path
        assert name in _definitions(ROOT / path), (path, name)
    for path in re.findall(r"`((?:mpicube|tests|tools|docs)/[\w/.-]+)`", text):
        assert (ROOT / path).exists(), path
    for page in re.findall(r"\]\(([\w.-]+\.md)\)", text):
        assert (ROOT / "docs" / page).is_file(), page


def test_every_citation_of_the_design_is_a_section_of_docs_design_md():
    """Docstrings and pages cite the design by section; the design is
    docs/design.md (a DESIGN.md outside the repository was cited 38 times),
    and each cited section is one it has."""
    import re

    root = Path(__file__).resolve().parents[1]
    design = (root / "docs" / "design.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.MULTILINE)}
    assert sections == set(range(1, 12)), sorted(sections)
    files = [*root.glob("mpicube/**/*.py"), *root.glob("tests/*.py"), *root.glob("docs/*.md"), root / "README.md"]
    stale, cited = [], []
    for path in files:
        text = " ".join(path.read_text().split())       # a citation may break across lines
        if re.search(r"(?<![/\w])DESIGN\.md", text) and path.name != "test_architecture.py":
            stale.append(str(path.relative_to(root)))
        cited += [(path.name, int(n)) for n in re.findall(r"design\.md\)? section (\d+)", text)]
    assert not stale, f"cite docs/design.md instead: {stale}"
    assert len(cited) >= 30 and all(n in sections for _, n in cited), cited
