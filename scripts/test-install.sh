#!/usr/bin/env bash
# What a new user meets, proven the way they meet it (part of the README's test command):
#  1. a brand-new virtual environment (.venvs/fresh, recreated every time) runs the README's
#     main-job block *verbatim* -- whatever transformers/matplotlib/... pip resolves today, no pins
#     beyond what that block installs -- and must exit 0 and leave a run folder with metrics.jsonl,
#     report.md, PNG plots and a model/ folder that transformers loads;
#  2. the core suite (everything but the tests that need TRL/verl/OpenRLHF/vLLM, which pin older
#     transformers) runs in that same venv, i.e. under the newest transformers;
#  3. the core suite runs under the declared transformers floor (scripts/test-transformers-range.sh).
# Usage: bash scripts/test-install.sh [extra pytest args for the core suites]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venvs/fresh
CORE_SUITE=(tests -q -p no:cacheprovider -m "not slow and not gpu and not frameworks"
            --ignore=tests/adapters --ignore=tests/sampler_vllm)

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

echo "== core suite under the newest transformers ($("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)'))"
# test tools only: nothing here may change what the README block installed
"$VENV/bin/python" -m pip install -q pytest pytest-timeout hypothesis scipy
"$VENV/bin/python" -m pytest "${CORE_SUITE[@]}" "$@"

echo "== core suite under the declared transformers floor"
bash scripts/test-transformers-range.sh "$@"
