"""The README's two commands: the first sets up and runs the demo, the second is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def two_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_the_first_command_sets_up_and_runs_the_demo_the_second_is_ci():
    demo, tests = two_commands()
    assert demo == "./scripts/setup.sh && .venv/bin/kvpath demo"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [tests]


def test_the_readme_fits_on_a_screen():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 50
