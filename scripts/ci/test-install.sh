#!/usr/bin/env bash
# What a new user meets, proven the way they meet it (part of the README's test command):
#  1. a brand-new virtual environment (.venvs/fresh, recreated every time) runs the README's
#     main-job block *verbatim* -- whatever transformers/matplotlib/... pip resolves today, no pins
#     beyond what that block installs -- and must exit 0 and leave a run folder with metrics.jsonl,
#     report.md, PNG plots and a model/ folder that transformers loads;
#  2. the core suite (everything but the tests that need TRL/verl/OpenRLHF/vLLM, which pin older
#     transformers) runs in that same venv, i.e. under the newest transformers;
#  3. the core suite runs under the declared transformers floor (scripts/ci/test-transformers-range.sh).
# Time (CI has 2 cores): the two core suites (3 with the floor's venv install) run side by side, one
# torch thread each (GRPO_PARTS_TEST_THREADS=1); the floor's output is printed when it ends.
# SERIAL=1 runs them one after the other instead.
# Usage: bash scripts/ci/test-install.sh [extra pytest args for the core suites]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venvs/fresh
CORE_SUITE=(tests -q -p no:cacheprovider -m "not slow and not gpu and not frameworks"
            --ignore=tests/adapters)

# The README's main-job block: the first ```bash block after the "**Main job**" paragraph.
MAIN_JOB=$(python3 - <<'EOF'
import re, sys
text = open("README.md").read()
m = re.search(r"\*\*Main job\*\*.*?```bash\n(.*?)```", text, re.S)
if not m:
    sys.exit("README.md: no ```bash block after **Main job**")
print(m.group(1).strip())
EOF
)

rm -rf "$VENV"
python3 -m venv "$VENV"
mkdir -p runs
before=$(ls runs)
echo "== README main job, verbatim, in a fresh $VENV: $MAIN_JOB"
(
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    eval "$MAIN_JOB"
)
run_dir=$(comm -13 <(echo "$before" | sort) <(ls runs | sort) | tail -n 1)
[ -n "$run_dir" ] || { echo "test-install: the main job made no run folder under runs/" >&2; exit 1; }
run_dir="runs/$run_dir"
"$VENV/bin/python" - "$run_dir" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
problems = []
for name in ("metrics.jsonl", "report.md", "status.json"):
    if not (run / name).is_file() or (run / name).stat().st_size == 0:
        problems.append(f"{name} missing or empty")
if not list(run.glob("*.png")):
    problems.append("no PNG plots")
status = json.loads((run / "status.json").read_text()) if (run / "status.json").is_file() else {}
if status.get("status") != "completed":
    problems.append(f"status.json says {status.get('status')!r}, expected 'completed'")
# the optimized parts must have run, not fallen back: speculation verified drafts, CPPO pruned
summary = status.get("summary", {})
if summary.get("accepted_per_verify") is None:
    problems.append("no speculative verification ran (summary.accepted_per_verify is None)")
if summary.get("lean_forward_fraction") != 1.0:  # the newest transformers must not turn it off
    problems.append(f"decode forwards left the lean path (summary.lean_forward_fraction={summary.get('lean_forward_fraction')})")
if not summary.get("kept_fraction", 1.0) < 1.0:
    problems.append(f"CPPO pruned nothing (summary.kept_fraction={summary.get('kept_fraction')})")
model_dir = run / "model"
if not (model_dir / "config.json").is_file():
    problems.append("no model/ folder (save_pretrained) in the run folder")
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
if problems:
    sys.exit(f"test-install: {run}: " + "; ".join(problems))
print(f"test-install: {run}: metrics.jsonl, report.md, {len(list(run.glob('*.png')))} PNGs, model/ loads")
EOF

NEWEST=$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')
# test tools only: nothing here may change what the README block installed
"$VENV/bin/python" -m pip install -q pytest pytest-timeout hypothesis scipy
if [ "${SERIAL:-0}" = 1 ]; then
    echo "== core suite under the newest transformers ($NEWEST)"
    "$VENV/bin/python" -m pytest "${CORE_SUITE[@]}" "$@"
    echo "== core suite under the declared transformers floor"
    bash scripts/ci/test-transformers-range.sh "$@"
    exit 0
fi
echo "== core suites under the newest transformers ($NEWEST) and the declared floor, side by side"
LOGS=$(mktemp -d)
export GRPO_PARTS_TEST_THREADS=1
# the floor's venv is installed (first use) inside this background job, after the main job's
# `pip install -e .`: two editable installs at once would both write src/grpo_parts.egg-info
# separate --basetemp: the two pytest sessions never share (or clean up) each other's tmp folders
bash scripts/ci/test-transformers-range.sh --basetemp="$LOGS/tmp_floor" "$@" > "$LOGS/floor.log" 2>&1 &
floor=$!
# Ctrl-C or a failure here must not leave the floor suite running behind the script
trap 'kill "$floor" 2>/dev/null || true' EXIT
newest_rc=0
"$VENV/bin/python" -m pytest "${CORE_SUITE[@]}" --basetemp="$LOGS/tmp_newest" "$@" || newest_rc=$?
floor_rc=0
wait "$floor" || floor_rc=$?
trap - EXIT
echo "== core suite under the declared transformers floor (ran beside the one above)"
cat "$LOGS/floor.log"
[ "$newest_rc" = 0 ] || { echo "test-install: core suite under transformers $NEWEST failed (exit $newest_rc)" >&2; exit 1; }
[ "$floor_rc" = 0 ] || { echo "test-install: core suite under the floor failed (exit $floor_rc)" >&2; exit 1; }
rm -rf "$LOGS"
