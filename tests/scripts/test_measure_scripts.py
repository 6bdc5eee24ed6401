"""scripts/measure/: each measurement the docs cite starts (its imports resolve) and explains its
arguments (``--help``: exit 0, a usage line, help text on every flag); no script reaches into a
private name of grpo_parts (they use the public spellings, as a user's script would)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
MEASURE = sorted((SCRIPTS / "measure").glob("*.py"))
PYTHON_SCRIPTS = sorted(SCRIPTS.rglob("*.py"))
SHELL_SCRIPTS = sorted(SCRIPTS.rglob("*.sh"))


def test_scripts_are_split_by_kind() -> None:
    assert not list(SCRIPTS.glob("*.*")), "scripts/ holds only the folders ci/, gpu/ and measure/"
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "ci",
        "gpu",
        "measure",
    ]
    assert len(MEASURE) >= 10


@pytest.mark.parametrize("script", MEASURE, ids=[p.name for p in MEASURE])
def test_measure_script_help(script: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(script.relative_to(ROOT)), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"usage: {script.name}"), r.stdout
    assert "-h, --help" in r.stdout


def test_bench_compare_help() -> None:
    r = subprocess.run(
        ["bash", "scripts/measure/bench_compare.sh", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: scripts/measure/bench_compare.sh")


def _add_argument_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
    ]


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=[str(p.relative_to(SCRIPTS)) for p in PYTHON_SCRIPTS])
def test_every_flag_has_help_text(script: Path) -> None:
    tree = ast.parse(script.read_text(), str(script))
    missing = [
        f"{script.name}:{c.lineno}"
        for c in _add_argument_calls(tree)
        if not any(k.arg == "help" for k in c.keywords)
    ]
    assert not missing, f"add_argument without help=: {missing}"


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=[str(p.relative_to(SCRIPTS)) for p in PYTHON_SCRIPTS])
def test_no_private_names_of_the_package(script: Path) -> None:
    """``from grpo_parts.x import _y``, ``grpo_parts._x`` modules, ``obj._attr`` on the package's
    objects and ``args._x`` Namespace attributes: a script uses what a user's script can."""
    text = script.read_text()
    tree = ast.parse(text, str(script))
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in (
            "grpo_parts",
            "grpo_parts_adapters",
        ):
            parts = (n.module or "").split(".") + [a.name for a in n.names]
            found += [
                f"{n.lineno}: {n.module} {p}" for p in parts if p.startswith("_") and not p.startswith("__")
            ]
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in ("grpo_parts", "grpo_parts_adapters") and any(
                    p.startswith("_") for p in a.name.split(".")
                ):
                    found.append(f"{n.lineno}: import {a.name}")
        elif (
            isinstance(n, ast.Attribute)
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("sys", "os", "self"))
        ):
            found.append(f"{n.lineno}: .{n.attr}")
    found += [f"args._ at offset {m.start()}" for m in re.finditer(r"\bargs\._", text)]
    assert not found, f"{script.relative_to(ROOT)} uses private names: {found}"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=[str(p.relative_to(SCRIPTS)) for p in SHELL_SCRIPTS])
def test_shell_scripts_parse(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
