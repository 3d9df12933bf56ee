"""Layers read top-down: the shared concepts in ``kvpath/`` import no part.

Read from the source (``ast``), so an import inside a function, under TYPE_CHECKING or
behind a lazy ``__getattr__`` counts too. ``kvpath/cli.py`` is the one module that
imports every part (each part adds its own subcommands).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("kvpath.connector", "kvpath.proxy", "kvpath.testbed", "kvpath.bridge", "kvpath.demo")
ENTRY_POINT = ROOT / "kvpath" / "cli.py"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module an ``import``/``from ... import`` in ``source`` names (relative ones resolved
    against ``package``)."""
    tree = ast.parse(source)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from kvpath import connector`
    return out


def part_imports(path: Path, package: str = "kvpath") -> list[str]:
    mods = imported_modules(path.read_text(), package)
    return sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in PARTS))


def test_shared_concepts_import_no_part():
    offenders = {str(p.relative_to(ROOT)): part_imports(p)
                 for p in sorted((ROOT / "kvpath").glob("*.py")) if p != ENTRY_POINT}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_cli_entry_point_imports_the_parts_that_add_subcommands():
    mods = part_imports(ENTRY_POINT)
    assert {p for p in PARTS if any(m == p or m.startswith(p + ".") for m in mods)} >= {
        "kvpath.proxy", "kvpath.testbed", "kvpath.bridge"}


def test_the_walker_sees_imports_of_every_form(tmp_path):
    """What would make the layering test pass while a part is imported: a form the walker misses."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvpath.proxy.app import create_app\n"
        "def f():\n    import kvpath.testbed.cli\n    from kvpath import connector\n    from .bridge import cli\n"
    )
    assert part_imports(probe) == sorted(["kvpath.bridge", "kvpath.bridge.cli", "kvpath.connector",
                                          "kvpath.proxy.app", "kvpath.proxy.app.create_app", "kvpath.testbed.cli"])


def sys_path_edits(source: str) -> list[int]:
    """Lines where ``source`` changes ``sys.path`` (a call on it, or an assignment to it)."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_module_edits_sys_path():
    """kvpath is imported as installed; a ``sys.path`` edit would make a module importable under two names."""
    folders = ("kvpath", "connector", "proxy", "testbed", "simulator_bridge", "tests", "benchmarks", "scripts")
    offenders = {str(p.relative_to(ROOT)): sys_path_edits(p.read_text())
                 for d in folders for p in sorted((ROOT / d).rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_sys_path_walker_sees_every_form():
    src = ("import sys\nsys.path.insert(0, 'a')\nsys.path.append('b')\nsys.path = ['c']\n"
           "sys.path[:0] = ['d']\nsys.path += ['e']\nprint(sys.path)\n")
    assert sys_path_edits(src) == [2, 3, 4, 5, 6]
