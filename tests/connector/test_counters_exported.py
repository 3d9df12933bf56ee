"""Every counter the connector increments is one vLLM's /metrics exports (COUNTERS)."""

import ast
import re
from pathlib import Path

from kvpath.connector.telemetry import COUNTERS

CONNECTOR = Path(__file__).resolve().parents[2] / "connector"


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


# The page whose "Telemetry and metrics" section lists the counters vLLM's /metrics exports
COUNTERS_DOC = CONNECTOR.parent / "docs" / "connector.md"


def _documented_counters() -> list[str]:
    doc = COUNTERS_DOC.read_text()
    section = doc.split("## Telemetry and metrics", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"`vllm:kvpath_\{(.*?)\}_total`", section, flags=re.S)
    assert listed, f"{COUNTERS_DOC.name}: no vllm:kvpath_{{...}}_total list under 'Telemetry and metrics'"
    return [name.strip() for name in listed.group(1).split(",")]


def test_the_docs_list_every_counter():
    listed = _documented_counters()
    undocumented = [c for c in COUNTERS if c not in listed]
    assert not undocumented, f"in telemetry.COUNTERS, not in {COUNTERS_DOC.name}'s list: {undocumented}"
    stale = [c for c in listed if c not in COUNTERS]
    assert not stale, f"in {COUNTERS_DOC.name}'s list, not in telemetry.COUNTERS: {stale}"
    assert len(listed) == len(set(listed)), "a counter listed twice"
