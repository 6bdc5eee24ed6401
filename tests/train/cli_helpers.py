"""Helpers of the CLI bad-input tests: run ``grpo-parts train`` expecting one refusal line, and byte
snapshots of a folder (a refused command must leave every run folder as it was)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_parts.cli import main

QUIET = ["--no-progress", "-q"]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))
    }


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    """Run the CLI; assert exit 2 and one line on stderr holding every fragment; return the line."""
    capsys.readouterr()
    rc = main(["train", *argv, *QUIET])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith("grpo-parts train: error: "), line
    for f in fragments:
        assert f in line, (f, line)
    return line
