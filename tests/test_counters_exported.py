"""Every counter the connector increments is one vLLM's /metrics exports (COUNTERS)."""

import ast
from pathlib import Path

from kvpath.connector.telemetry import COUNTERS

CONNECTOR = Path(__file__).resolve().parents[1] / "connector"


def _incremented() -> dict[str, str]:
    out = {}
    for path in sorted(CONNECTOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "inc"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "stats" and node.args):
                for c in ast.walk(node.args[0]):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        out[c.value] = f"{path.name}:{node.lineno}"
    return out


def test_every_incremented_counter_is_exported():
    seen = _incremented()
    assert "lanes_reserve_fallback" in seen and "pushes_ok" in seen  # the walk finds them
    missing = {name: where for name, where in seen.items() if name not in COUNTERS}
    assert not missing, f"incremented but not in telemetry.COUNTERS (never reach /metrics): {missing}"


def test_the_docs_list_every_counter():
    doc = (CONNECTOR.parent / "docs" / "connector.md").read_text()
    undocumented = [c for c in COUNTERS if c not in doc]
    assert not undocumented, undocumented
