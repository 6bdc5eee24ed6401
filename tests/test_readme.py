"""The README's pick-and-mix example (as written and with each commented alternative) and the CLI's
--help must keep working."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_parts.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _variants(code: str) -> list[tuple[str, str]]:
    """The block as written, then once per commented alternative: a line ``# NAME = ...`` right after
    a line ``NAME = ...`` replaces it (``# sampler = get_sampler_class("speculative")(...)``)."""
    lines = code.splitlines()
    out = [("as written", code)]
    for i in range(1, len(lines)):
        m = re.match(r"# (\w+) = ", lines[i])
        if m and lines[i - 1].startswith(f"{m.group(1)} = "):
            out.append((lines[i][2:], "\n".join([*lines[: i - 1], lines[i][2:], *lines[i + 1 :]])))
    return out


BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
VARIANTS = [v for code in BLOCKS for v in _variants(code)]


def test_readme_has_examples_and_the_speculative_alternative() -> None:
    assert BLOCKS, "README.md has no python example"
    assert any('get_sampler_class("speculative")' in name for name, _ in VARIANTS)


@pytest.mark.parametrize("code", [c for _, c in VARIANTS], ids=[n for n, _ in VARIANTS])
def test_readme_python_blocks_run(code: str) -> None:
    exec(compile(code, "README.md", "exec"), {})


def test_readme_names_the_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = "bash scripts/ci/install-dev.sh && python -m pytest && bash scripts/ci/test-vllm.sh && bash scripts/ci/test-install.sh"
    assert cmd in readme, "README's test command changed: update .ci/run and this test together"
    assert cmd in ci, ".ci/run must run exactly the README's test command"


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    assert "bench" in capsys.readouterr().out
