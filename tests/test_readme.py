"""The README's set-up commands are what CI runs, and what they name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_exactly_two_commands() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("yeto launch")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in [line.strip() for line in ci]


def test_setup_uses_the_constraints_that_pin_cpu_torch() -> None:
    assert "torch==2.13.0+cpu" in (ROOT / "constraints.txt").read_text()  # not the CUDA build
    assert all("-c constraints.txt" in c for c in _setup_commands())
