"""scripts/measure/bench_compare.sh on throwaway repositories (so the tests need no history: CI's clone may
be shallow). A stub ``grpo_parts`` whose bench returns known values per revision and round checks
the alternation, min / median / B/A and the --json file in a second; the real attention bench on a
tiny configuration (this checkout's ``src/grpo_parts`` committed twice, one point run and one
skipped, one round) checks the printed table end to end. Also: the worktrees are removed, a bad
revision is one line."""

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
SCRIPT = ROOT / "scripts" / "measure" / "bench_compare.sh"
TINY = ["--quick", "--max-ref-tokens", "2000", "--hidden", "32", "--layers", "1", "--heads", "2"]
TINY += ["--kv-heads", "1", "--intermediate", "64", "--vocab", "64", "--repeats", "1", "--threads", "1"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout


def _two_commits(repo: Path, second: Path) -> None:
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a")
    second.write_text("# the second revision\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "b")


#: a grpo_parts whose `bench` writes speedup = (1 for the first revision, 2 for the second) + 0.1 x
#: (how many runs of that revision came before), and logs each run's revision
STUB_CLI = """
import json, os, sys
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rev = "b" if os.path.exists(os.path.join(os.path.dirname(__file__), "second.py")) else "a"
    log = os.environ["STUB_LOG"]
    done = open(log).read().split() if os.path.exists(log) else []
    open(log, "a").write(rev + "\\n")
    value = (2.0 if rev == "b" else 1.0) + 0.1 * done.count(rev)
    point = {"G": 8, "P": 1024, "S": 128, "ideal": 4.0, "speedup": value, "time_ref_s": 4.0 * value, "time_shared_s": 4.0}
    json.dump([point, {"G": 1, "P": 1, "S": 1, "speedup": None, "skipped": "too big"}], open(argv[-1], "w"))
    return 0
"""


@pytest.fixture(scope="module")
def stub_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("stub")
    pkg = repo / "src" / "grpo_parts"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text(STUB_CLI)
    _two_commits(repo, pkg / "second.py")
    return repo


def test_alternation_min_median_and_json(stub_repo: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "cmp.json", tmp_path / "runs.log"
    r = _run(
        stub_repo,
        "--rounds",
        "3",
        "--json",
        str(out),
        "HEAD~1",
        "HEAD",
        "attention",
        env={"STUB_LOG": str(log)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text().split() == ["a", "b", "b", "a", "a", "b"]  # A B, B A, A B
    lines = r.stdout.splitlines()
    assert "  3 rounds, alternating" in next(x for x in lines if "rounds" in x)
    assert [x.split(":")[0] for x in lines if x.startswith("  round")] == [
        "  round 1", "  round 1", "  round 2", "  round 2", "  round 3", "  round 3"
    ]  # fmt: skip
    # A: 1.0 1.1 1.2, B: 2.0 2.1 2.2 -> min, median, B/A = 2.1/1.1, B/ideal = 2.1/4
    ratio_part = lines[: next(i for i, x in enumerate(lines) if x.startswith("per-arm times"))]
    rows = {" ".join(x.split()[:3]): x.split()[3:] for x in ratio_part if x.startswith("G=")}
    assert rows["G=8 P=1024 S=128"] == ["1.000", "1.100", "2.000", "2.100", "1.909", "0.525"]
    assert rows["G=1 P=1 S=1"] == ["skipped", "(too", "big)"]
    data = json.loads(out.read_text())
    point, skipped = data["points"]
    assert point["A"] == [1.0, 1.1, 1.2] and point["B"] == [2.0, 2.1, 2.2]
    assert point["B_over_A"] == pytest.approx(2.1 / 1.1) and point["B_of_ideal"] == pytest.approx(2.1 / 4)
    assert skipped == {"point": "G=1 P=1 S=1", "A": [None] * 3, "B": [None] * 3, "skipped": "too big"}
    # each arm's own time: the reference moved (4.4 -> 8.4 s median), the shared arm did not
    arms = [x.split()[3:] for x in lines[len(ratio_part) :] if x.startswith("G=8")]
    assert arms == [["time_ref_s", "4.400", "8.400", "1.909"], ["time_shared_s", "4.000", "4.000", "1.000"]]
    assert point["times"]["time_shared_s"]["B_over_A"] == 1.0
    assert len(_git(stub_repo, "worktree", "list").splitlines()) == 1  # the temporary worktrees are gone


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", "assets")  # the bench needs no warm starts
    shutil.copytree(ROOT / "src" / "grpo_parts", repo / "src" / "grpo_parts", ignore=ignore)
    _two_commits(repo, repo / "src" / "grpo_parts" / "_second.py")
    return repo


def _run(repo: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **(env or {})}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )


def test_attention_bench_two_revisions(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    r = _run(repo, "--rounds", "1", "--json", str(out), "HEAD~1", "HEAD", "attention", *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    a_sha, b_sha = _git(repo, "rev-parse", "HEAD~1", "HEAD").split()
    assert f"  A = HEAD~1 ({a_sha[:10]})" in lines
    assert f"  B = HEAD ({b_sha[:10]})" in lines
    rounds = [m.groups() for m in (re.match(r"  round (\d): ([AB]) done", x) for x in lines) if m]
    assert rounds == [("1", "A"), ("1", "B")]
    head = next(x for x in lines if x.startswith("point"))
    assert head.split() == ["point", "A", "min", "A", "med", "B", "min", "B", "med", "B/A", "B/ideal"]
    num = r"\d+\.\d{3}"
    assert any(re.fullmatch(rf"G=4 P=256 S=64\s+({num}\s+){{5}}{num}", x) for x in lines), r.stdout
    assert any(
        re.fullmatch(r"G=8 P=1024 S=128\s+skipped \(reference batch 9216 tokens.*\)", x) for x in lines
    )
    data = json.loads(out.read_text())
    assert data["metric"] == "speedup" and data["rounds"] == 1
    point, skipped = data["points"]
    assert point["point"] == "G=4 P=256 S=64" and len(point["A"]) == len(point["B"]) == 1
    assert point["B_over_A"] == pytest.approx(point["B"][0] / point["A"][0])
    assert set(point["times"]) >= {"time_ref_s", "time_shared_s"}
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
