"""The tree keeps the architecture that docs/architecture.md describes: rooms by side, imports in
one direction and without circles, files short enough to read or saying why they are not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE = CHECKOUT / "tnt_notebook"


def module_name(path: Path) -> str:
    parts = path.relative_to(CHECKOUT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The tnt_notebook modules that `path` imports, at its top or inside its functions (type-only
    imports left out: they never run)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    (package or module_name(path)).split(".")[: 1 - node.level] + [base]
                )
            found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {m for m in found if m.startswith("tnt_notebook")}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The package's own modules that module `name` imports."""
    return {m for m in imported(MODULES[name]) if m in MODULES and m != name}


def test_no_module_imports_another_in_a_circle():
    graph = {name: imports_of(name) - {"tnt_notebook"} for name in MODULES}
    state: dict[str, int] = {}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                circles.append(" -> ".join([*path[path.index(other) :], other]))
            elif other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("room", ["rank", "keras"])
def test_rank_side_code_never_imports_notebook_side_code(room: str):
    rank_side = [name for name in MODULES if name.startswith(f"tnt_notebook.{room}")]
    assert rank_side
    reaching = {n: sorted(m for m in imports_of(n) if ".notebook" in m) for n in rank_side}
    assert {n: m for n, m in reaching.items() if m} == {}


@pytest.mark.parametrize("room", ["notebook", "cluster"])
def test_the_notebook_and_launcher_sides_never_import_tensorflow_or_keras(room: str):
    for name, path in MODULES.items():
        if name.startswith(f"tnt_notebook.{room}"):
            heavy = [
                n.names[0].name if isinstance(n, ast.Import) else n.module
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Import | ast.ImportFrom)
            ]
            assert not [m for m in heavy if m and m.split(".")[0] in ("tensorflow", "keras")], name


def test_a_file_over_500_lines_says_why_at_its_top():
    sources = [
        p
        for pattern in ("tnt_notebook/**/*.py", "native/**/*.[ch]pp", "tests/**/*.py")
        for p in CHECKOUT.glob(pattern)
    ]
    assert len(sources) > 100
    long = [p for p in sources if p.read_text().count("\n") > 500]
    unexplained = [p for p in long if "Over 500 lines:" not in p.read_text()[:1500]]
    assert [str(p.relative_to(CHECKOUT)) for p in unexplained] == []
