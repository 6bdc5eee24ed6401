"""The explicit package list in pyproject.toml covers every package folder, and ``adapters/``
installs as ``grpo_parts_adapters`` without importing any framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[3]


def _declared() -> tuple[set[str], dict[str, str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), cfg["package-dir"]


def _tracked_package_dirs() -> set[Path]:
    """Folders with an ``__init__.py`` that git tracks (untracked work in progress is not shipped)."""
    out = subprocess.run(
        ["git", "ls-files", "--", "src", "adapters"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:  # not a git checkout (e.g. an sdist): fall back to the file system
        return {p.parent for p in [*ROOT.glob("src/**/__init__.py"), *ROOT.glob("adapters/**/__init__.py")]}
    return {(ROOT / f).parent for f in out.stdout.split() if f.endswith("__init__.py")}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    packages, package_dir = _declared()
    roots = {name: ROOT / folder for name, folder in package_dir.items() if name}
    missing = []
    for folder in sorted(_tracked_package_dirs()):
        if "__pycache__" in folder.parts:
            continue
        name = None
        for pkg, root in roots.items():
            if folder == root or root in folder.parents:
                name = ".".join([pkg, *folder.relative_to(root).parts])
        if name is None:
            name = ".".join(folder.relative_to(ROOT / package_dir[""]).parts)
        if name not in packages:
            missing.append(name)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def test_listed_packages_exist() -> None:
    packages, package_dir = _declared()
    for name in packages:
        top = name.split(".")[0]
        base = ROOT / package_dir[top] if top in package_dir else ROOT / package_dir[""] / top
        folder = base.joinpath(*name.split(".")[1:])
        assert (folder / "__init__.py").is_file(), (
            f"pyproject lists {name!r} but {folder}/__init__.py is missing"
        )


def test_adapters_import_lazily() -> None:
    code = (
        "import sys, grpo_parts_adapters.trl as t; "
        "assert 'trl' not in sys.modules, 'importing the adapter package must not import TRL'; "
        "print(t.TRLPartsOptions().strict)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_tested_trl_range_is_the_trl_extra() -> None:
    from grpo_parts_adapters.trl.options import TESTED_TRL

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    assert f"trl{TESTED_TRL}" in extra
