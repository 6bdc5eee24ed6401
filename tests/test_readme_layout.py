"""README.md's "Layout" section describes the tree as it is: every path it names in backticks exists
(``{a,b}`` braces and ``*`` globs expanded), and every package of ``src/grpo_parts``, every adapter
and every scripts/ folder is named there."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "README.md has no '## Layout' section"
    return m.group(1)


def expand_braces(pattern: str) -> list[str]:
    """``a/{b,c}/d`` -> ``["a/b/d", "a/c/d"]`` (several brace groups: every combination)."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*options)]


def named_paths() -> list[str]:
    """Backticked words with a ``/`` and nothing but path characters: ``src/grpo_parts/core/``, not
    ``pip install -e ".[trl]"`` or ``protocol.py`` (a file of every Protocol package)."""
    found = re.findall(r"`([^`\s]+)`", layout_section())
    return [w for w in found if "/" in w and re.fullmatch(r"[\w.{},*/-]+", w)]


PATHS = named_paths()


def test_layout_names_paths() -> None:
    assert len(PATHS) >= 15, PATHS


@pytest.mark.parametrize("pattern", PATHS)
def test_every_named_path_exists(pattern: str) -> None:
    for path in expand_braces(pattern):
        matches = list(ROOT.glob(path.rstrip("/"))) if "*" in path else [ROOT / path]
        assert matches and all(p.exists() for p in matches), f"README Layout names {path!r}: not in the tree"
        if path.endswith("/"):
            assert all(p.is_dir() for p in matches), f"README Layout names {path!r} as a folder"


def test_every_package_and_script_folder_is_named() -> None:
    named = {p.rstrip("/") for pattern in PATHS for p in expand_braces(pattern)}
    pkg = ROOT / "src" / "grpo_parts"
    expected = {
        str(d.relative_to(ROOT))
        for d in [*pkg.iterdir(), *(pkg / "sampler").iterdir(), *(pkg / "attention").iterdir()]
        if d.is_dir() and (d / "__init__.py").is_file()
    }
    expected |= {
        str(d.relative_to(ROOT)) for d in (ROOT / "adapters").iterdir() if (d / "__init__.py").is_file()
    }
    expected |= {
        str(d.relative_to(ROOT))
        for d in (ROOT / "scripts").iterdir()
        if d.is_dir() and d.name != "__pycache__"
    }
    missing = sorted(expected - named)
    assert not missing, f"README Layout does not name: {missing}"
