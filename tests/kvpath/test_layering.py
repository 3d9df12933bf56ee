"""Layers read top-down: the shared concepts in ``kvpath/`` import no part.

Read from the source (``ast``), so an import inside a function, under TYPE_CHECKING or
behind a lazy ``__getattr__`` counts too. ``kvpath/cli.py`` is the one module that
imports every part (each part adds its own subcommands).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
                 for p in sorted((ROOT / "kvpath").rglob("*.py")) if p != ENTRY_POINT}
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


# Import cycles that remain, each with where it goes (a test that fails when one is
# added, and when one of these is gone but still listed).
def project_modules() -> dict[str, Path]:
    """Every module of the installed namespace (pyproject's package-dir), by its name."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods: dict[str, Path] = {}
    for package, folder in cfg.items():
        for p in sorted((ROOT / folder).rglob("*.py")):  # subpackages too (kvpath/workloads/)
            parts = [package, *p.relative_to(ROOT / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to the longest module it
    starts with). A module's own ancestor packages are left out: Python imports them
    before the module in any case, so they close no cycle."""
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        package = name if p.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for m in imported_modules(p.read_text(), package):
            while m and m not in mods:
                m = m.rpartition(".")[0]
            if m and m != name and not name.startswith(m + "."):
                edges.add(m)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def test_no_import_cycle_among_the_projects_modules():
    mods = project_modules()
    assert {"kvpath.connector.sender", "kvpath.bridge.compare", "kvpath.trace", "kvpath.workloads.load",
            "kvpath.reservation.wire"} <= set(mods)
    assert cycles(import_graph(mods)) == set()


def test_the_cycle_finder_sees_long_and_function_level_cycles(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert cycles({"a": {"b"}, "b": set()}) == set()
    # an import inside a function and one under TYPE_CHECKING close a cycle too;
    # a module's import of its own package does not
    (tmp_path / "pkg").mkdir()
    files = {"pkg/__init__.py": "def f():\n    from pkg import x\n",
             "pkg/x.py": "from pkg import y\n",
             "pkg/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.x import X\n"}
    for rel, src in files.items():
        (tmp_path / rel).write_text(src)
    mods = {"pkg": tmp_path / "pkg/__init__.py", "pkg.x": tmp_path / "pkg/x.py", "pkg.y": tmp_path / "pkg/y.py"}
    assert cycles(import_graph(mods)) == {frozenset({"pkg.x", "pkg.y"})}


def test_the_connector_imports_no_proxy_testbed_or_bridge_module():
    graph = import_graph(project_modules())
    others = ("kvpath.proxy", "kvpath.testbed", "kvpath.bridge", "kvpath.demo")
    offenders = {m: sorted(t for t in targets if any(t == o or t.startswith(o + ".") for o in others))
                 for m, targets in graph.items() if m == "kvpath.connector" or m.startswith("kvpath.connector.")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_reservation_package_imports_a_web_framework_only_in_its_http_app():
    """Its decisions and wire load inside vLLM's processes (P's connector) and in the
    simulator: FastAPI, starlette and pydantic stay with the HTTP service (app.py, and
    cli.py, which serves it with uvicorn)."""
    web = ("fastapi", "starlette", "pydantic", "uvicorn")
    offenders = {}
    mods = project_modules()
    assert "kvpath.reservation.app" in mods
    for name, p in mods.items():
        if (name == "kvpath.reservation" or name.startswith("kvpath.reservation.")) and name not in (
                "kvpath.reservation.app", "kvpath.reservation.cli"):
            package = name if p.name == "__init__.py" else name.rpartition(".")[0]
            hits = sorted(m for m in imported_modules(p.read_text(), package) if m.split(".")[0] in web)
            if hits:
                offenders[name] = hits
    assert offenders == {}


def test_every_package_on_disk_is_a_package_of_the_wheel():
    """A subpackage missing from pyproject's list works in the editable install and is
    absent from the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {name for name, p in project_modules().items() if p.name == "__init__.py"}
    assert on_disk == set(setuptools["packages"])


# -- the connector's parts keep their state to themselves ------------------------------
CONNECTOR = ROOT / "connector"


def private_names(paths: list[Path]) -> set[str]:
    """Underscore names the modules define: their functions, methods and classes, and
    the attributes their methods set on ``self``."""
    out: set[str] = set()
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_reads(source: str, names: set[str]) -> list[str]:
    """``x._name`` for a ``_name`` in ``names`` on anything but ``self`` or ``cls``: one
    object reading (or setting) another's private attribute."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
    return hits


def test_no_connector_part_reads_another_parts_private_state_and_nothing_outside_reads_any():
    names = private_names(sorted(CONNECTOR.glob("*.py")))
    assert {"_commands", "_lock", "_regs"} <= names  # what the walker must see
    everywhere = [p for p in sorted(ROOT.rglob("*.py"))
                  if not {".venv", "build", ".git"} & set(p.relative_to(ROOT).parts)]
    offenders = {str(p.relative_to(ROOT)): hits for p in everywhere
                 if (hits := private_reads(p.read_text(), names))}
    assert offenders == {}


def test_the_private_read_check_sees_a_part_reading_another_and_spares_self():
    names = private_names([CONNECTOR / "sender.py"])
    src = ("class A:\n    def f(self, other):\n        self._x = 1\n        return other._x, self.lanes._y\n")
    assert private_reads(src, {"_x", "_y"}) == ["4: other._x", "4: self.lanes._y"]
    assert private_reads("def g(cls):\n    return cls._x\n", {"_x"}) == []
    assert "_busy_peers" in names
