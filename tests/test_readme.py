"""The README's pick-and-mix example and the CLI's --help must keep working."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_parts.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_readme_names_the_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = "bash scripts/install-dev.sh && python -m pytest && bash scripts/test-vllm.sh && bash scripts/test-install.sh"
    assert cmd in readme, "README's test command changed: update .ci/run and this test together"
    assert cmd in ci, ".ci/run must run exactly the README's test command"


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    assert "bench" in capsys.readouterr().out
