#!/usr/bin/env bash
# One GPU check for the first device lent (<= 8.5 minutes on one H200): every GPU number this project
# lacks, in one run. Writes $OUT/gpu_check.json and $OUT/gpu_check.md (a summary), plus each step's
# log and outputs under $OUT (default /tmp/grpo_parts_gpu_check).
#
#   scripts/gpu/gpu_check.sh            # on a CUDA machine
#   scripts/gpu/gpu_check.sh --dry-run  # anywhere (CI): prints what it would run, checks the imports,
#                                   # the commands' argument parsing and the summary, runs no GPU step
#
# Steps (each under its own time limit, seconds; a failed or timed-out step is recorded and the
# next one runs; the exit status is 1 when any step failed):
#   e2e          grpo-parts bench e2e --device cuda --preset h200 (tokens/s/GPU per arm)     215
#   vlm_attention grpo-parts bench attention --vlm --device cuda: Qwen2-VL prompts of 256 and
#                1,024 image tokens, shared prefix against the reference, vision tower included  25
#   verl_prefix  scripts/measure/verl_prefix_bench.py: verl padded/packed forward, verl's own Prefix
#                Grouper (flash-attn) and grpo_parts' shared prefix, one FSDP engine           60
#   vllm         the vLLM sampler tests (tests/sampler/vllm) on the GPU build of vLLM             40
#   vllm_online  scripts/gpu/vllm_online_draft.py: vLLM draft_model speculation, static k vs the
#                cost model's k per batch size vs that plus the draft trained online             35
#   verl_smoke   scripts/gpu/verl_gpu_smoke.py: first-batch check + a 2-step verl GRPO run       70
#   openrlhf     scripts/gpu/openrlhf_gpu_smoke.sh ... attention: OpenRLHF GRPO, the part on    55
# Needs on the GPU machine: torch with CUDA, verl's and OpenRLHF's GPU stacks, vllm, flash-attn
# (see docs/adapters/*.md); GPU_CHECK_PYTHON picks the interpreter. Commit the output under
# docs/results/ (see docs/results.md).
set -uo pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-/tmp/grpo_parts_gpu_check}"
PY="${GPU_CHECK_PYTHON:-python}"
mkdir -p "$OUT"
STEPS="$OUT/steps.jsonl"
: > "$STEPS"
cd "$REPO"

# name | limit (s) | command (run with bash -c, from the repository root)
PLAN=(
  "e2e|215|grpo-parts bench e2e --device cuda --preset h200 --json $OUT/e2e.json"
  "vlm_attention|25|grpo-parts bench attention --vlm --device cuda --repeats 3 --json $OUT/attention_vlm.json"
  "verl_prefix|60|$PY scripts/measure/verl_prefix_bench.py --repeats 3 --model $OUT/verl_prefix_model"
  "vllm|40|$PY -m pytest -q -x -p no:cacheprovider tests/sampler/vllm"
  "vllm_online|35|$PY scripts/gpu/vllm_online_draft.py --rollouts 6 --json $OUT/vllm_online.json"
  "verl_smoke|70|$PY scripts/gpu/verl_gpu_smoke.py --workdir $OUT/verl_smoke --attention shared_prefix --filter cppo --steps 2 --out $OUT/verl_smoke.json"
  "openrlhf|55|SMOKE_JSON=$OUT/openrlhf_smoke.json SMOKE_TIMEOUT=50 bash scripts/gpu/openrlhf_gpu_smoke.sh $OUT/openrlhf attention"
)

record() {  # name limit rc seconds command
  "$PY" -c 'import json, sys; n, l, r, s, c = sys.argv[1:]; print(json.dumps({"name": n, "limit_s": int(l), "rc": int(r), "seconds": float(s), "command": c}))' "$@" >> "$STEPS"
}

if [ "$DRY" = 1 ]; then
  echo "gpu_check --dry-run: would run, in $REPO, writing $OUT:"
  for step in "${PLAN[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    printf '  [%-11s <= %3ss] %s\n' "$name" "$limit" "$cmd"
  done
  fail=0
  check() {  # name command: a CUDA-free check of a step's pieces
    local name="$1"; shift
    if bash -c "$*" > "$OUT/dry_$name.log" 2>&1; then echo "  ok      $name"; record "dry_$name" 0 0 0 "$*"
    else echo "  FAILED  $name (see $OUT/dry_$name.log)"; record "dry_$name" 0 1 0 "$*"; fail=1; fi
  }
  echo "checks (no GPU):"
  check imports "$PY -c 'import torch, grpo_parts, grpo_parts_adapters; from grpo_parts.bench import gpu_e2e; assert \"h200\" in gpu_e2e.PRESETS'"
  check e2e_args "grpo-parts bench e2e --help | grep -q -- --preset"
  check vlm_attention_args "grpo-parts bench attention --help | grep -q -- --device && grpo-parts bench attention --help | grep -q -- --vlm"
  check verl_prefix_args "$PY scripts/measure/verl_prefix_bench.py --help > /dev/null"
  check vllm_online_configs "$PY scripts/gpu/vllm_online_draft.py --dry-run"
  check openrlhf_script "bash -n scripts/gpu/openrlhf_gpu_smoke.sh && $PY scripts/gpu/openrlhf_smoke_check.py --help > /dev/null"
  if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('verl') is None)"; then
    check verl_smoke_assets "$PY scripts/gpu/verl_gpu_smoke.py --dry-run --workdir $OUT/verl_smoke_dry --prompts 4 --attention shared_prefix --filter cppo"
  else
    echo "  skipped verl_smoke_assets (verl not installed here)"
  fi
  "$PY" - <<'PYEOF'  # needed on the GPU machine only (found = installed, not imported)
import importlib.util
for mod in ("vllm", "flash_attn", "verl", "openrlhf", "deepspeed"):
    found = importlib.util.find_spec(mod) is not None
    print(f"  {'found  ' if found else 'missing'} {mod}{'' if found else ' (needed on the GPU machine)'}")
PYEOF
  "$PY" scripts/gpu/gpu_check_summary.py "$OUT" --dry-run || fail=1
  exit $fail
fi

"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))' || exit 1
fail=0
for step in "${PLAN[@]}"; do
  IFS='|' read -r name limit cmd <<< "$step"
  echo "=== $name (<= ${limit}s): $cmd"
  start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  secs=$("$PY" -c "print(round($end - $start, 1))")
  record "$name" "$limit" "$rc" "$secs" "$cmd"
  echo "    rc=$rc in ${secs}s (log: $OUT/$name.log)"
  [ "$rc" = 0 ] || fail=1
done
"$PY" scripts/gpu/gpu_check_summary.py "$OUT" || fail=1
exit $fail
