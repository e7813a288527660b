"""The layering rules of docs/ARCHITECTURE.md, held against the code's imports: a rule that
only the docs state is broken by the first hurried change."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("fusefs", "chunkstore", "metadata", "bench")
MAX_LINES = 900


def _modules(pkg: str) -> list[pathlib.Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Every module an import statement in the file names (at any depth of the code)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize(
    "pkg,forbidden",
    [
        ("chunkstore", {"fusefs", "metadata", "bench", "tests"}),
        ("metadata", {"fusefs", "chunkstore", "bench", "tests"}),
        ("fusefs", {"bench", "tests"}),
        ("bench", {"tests"}),
    ],
)
def test_imports_point_one_way(pkg, forbidden):
    bad = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _modules(pkg)
        for m in _imports(p)
        if _top(m) in forbidden
    ]
    assert bad == []


def test_frontends_never_see_the_database_library():
    """The mount and the tier reach SQLite through the engine interface only."""
    bad = [
        str(p.relative_to(ROOT))
        for pkg in ("fusefs", "chunkstore")
        for p in _modules(pkg)
        if any(_top(m) in ("sqlite3", "psycopg") for m in _imports(p))
    ]
    assert bad == []


def test_no_module_is_over_the_size_limit():
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for pkg in ("fusefs", "chunkstore", "metadata")
        for p in _modules(pkg)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert big == []


def test_every_package_directory_is_a_package():
    """A sub-package without __init__.py would be left out of the wheel."""
    missing = [
        str(d.relative_to(ROOT))
        for pkg in PACKAGES
        for d in [ROOT / pkg, *(ROOT / pkg).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]  # fmt: skip
    assert missing == []
