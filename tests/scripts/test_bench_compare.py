"""scripts/bench_compare.sh on a tiny configuration: two revisions of a throwaway repository (this
checkout's ``src/grpo_parts`` committed twice, so the test needs no history: CI's clone may be
shallow), one attention point run and one skipped, two alternating rounds; the printed table, the
--json file, the cleanup of the worktrees, and a bad revision's one-line error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_compare.sh"
TINY = ["--quick", "--max-ref-tokens", "2000", "--hidden", "32", "--layers", "1", "--heads", "2"]
TINY += ["--kv-heads", "1", "--intermediate", "64", "--vocab", "64", "--repeats", "1", "--threads", "1"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", "assets")  # the bench needs no warm starts
    shutil.copytree(ROOT / "src" / "grpo_parts", repo / "src" / "grpo_parts", ignore=ignore)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a")
    (repo / "src" / "grpo_parts" / "_second.py").write_text("# the second revision\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "b")
    return repo


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )


def test_two_revisions_alternate_and_report_min_median(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    r = _run(repo, "--rounds", "2", "--json", str(out), "HEAD~1", "HEAD", "attention", *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    a_sha, b_sha = _git(repo, "rev-parse", "HEAD~1", "HEAD").split()
    assert f"  A = HEAD~1 ({a_sha[:10]})" in lines
    assert f"  B = HEAD ({b_sha[:10]})" in lines
    rounds = [m.groups() for m in (re.match(r"  round (\d): ([AB]) done", x) for x in lines) if m]
    assert rounds == [("1", "A"), ("1", "B"), ("2", "B"), ("2", "A")]
    head = next(x for x in lines if x.startswith("point"))
    assert head.split() == ["point", "A", "min", "A", "med", "B", "min", "B", "med", "B/A", "B/ideal"]
    num = r"\d+\.\d{3}"
    assert any(re.fullmatch(rf"G=4 P=256 S=64\s+({num}\s+){{5}}{num}", x) for x in lines), r.stdout
    assert any(
        re.fullmatch(r"G=8 P=1024 S=128\s+skipped \(reference batch 9216 tokens.*\)", x) for x in lines
    )
    data = json.loads(out.read_text())
    assert data["metric"] == "speedup" and data["rounds"] == 2
    point, skipped = data["points"]
    assert point["point"] == "G=4 P=256 S=64" and len(point["A"]) == len(point["B"]) == 2
    assert point["A_min"] == min(point["A"]) and point["B_median"] == pytest.approx(sum(point["B"]) / 2)
    assert point["B_over_A"] == pytest.approx(point["B_median"] / point["A_median"])
    assert "skipped" in skipped
    assert len(_git(repo, "worktree", "list").splitlines()) == 1  # the temporary worktrees are gone


def test_bad_revision_is_one_line(repo: Path) -> None:
    r = _run(repo, "HEAD", "no-such-rev", "attention", "--quick")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"bench_compare: REV_B: 'no-such-rev' is not a commit of {repo.resolve()} "
        "(a shallow clone may lack it: git fetch --unshallow)"
    ]
    assert len(_git(repo, "worktree", "list").splitlines()) == 1
