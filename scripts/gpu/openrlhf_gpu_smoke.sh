#!/usr/bin/env bash
# GPU smoke test of the OpenRLHF adapter: a tiny random model, a few GRPO steps of OpenRLHF 0.11.2
# (Ray + DeepSpeed + vLLM) per configuration, each grpo_parts part switched on in turn.
#
# Needs one CUDA GPU and OpenRLHF's GPU stack in the current Python (vLLM, flash-attn, DeepSpeed):
#   pip install "openrlhf[vllm]==0.11.2"     # its own torch/transformers/vLLM pins; use a fresh venv
#   pip install --no-deps -e .               # grpo_parts + grpo_parts_adapters on top
# Usage: scripts/gpu/openrlhf_gpu_smoke.sh [OUT_DIR] [CONFIG...]
#   CONFIG in: baseline filter attention attention_packed speculative all (default: every one).
# Each run writes OUT_DIR/<config>.log and .rc. Then scripts/gpu/openrlhf_smoke_check.py checks the
# numbers OpenRLHF logged per step, not exit codes: every part a configuration switches on ran
# (parts/<part>/<calls> > 0) and never fell back, policy_loss is finite, and the first batch's
# log-probs with and without shared-prefix attention agree (bf16 tolerance, SMOKE_LOGPROB_TOL).
# It writes SMOKE_JSON (default docs/openrlhf_gpu_smoke.json) and its exit status is the script's.
# Not run in CI (no GPU there); see docs/adapters/openrlhf.md.
set -euo pipefail

OUT="${1:-/tmp/grpo_parts_openrlhf_smoke}"
shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=(baseline filter attention attention_packed speculative all)
PY="${PYTHON:-python}"
TIMEOUT="${SMOKE_TIMEOUT:-600}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
JSON="${SMOKE_JSON:-$REPO/docs/openrlhf_gpu_smoke.json}"
mkdir -p "$OUT"

"$PY" - <<'EOF'
import torch, vllm, flash_attn, deepspeed, openrlhf  # noqa: F401  -- fail fast on a missing GPU stack
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__}, vllm {vllm.__version__}, flash_attn {flash_attn.__version__}, deepspeed {deepspeed.__version__}")
EOF

# A tiny Qwen2 with a character tokenizer, a toy addition data set and a reward function.
OUT="$OUT" "$PY" - <<'EOF'
import json, os, random
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from grpo_parts.tiny import tiny_causal_lm

out = os.environ["OUT"]
specials, chars = ["<pad>", "<eos>", "<unk>"], "0123456789+= "
vocab = {t: i for i, t in enumerate([*specials, *chars])}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
tok.decoder = decoders.Fuse()
tok.add_special_tokens(specials)
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
model = tiny_causal_lm("qwen2", vocab_size=32, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       max_position_embeddings=256, dtype=torch.bfloat16)
model.config.eos_token_id, model.config.pad_token_id = 1, 0
model.save_pretrained(f"{out}/model")
hf_tok.save_pretrained(f"{out}/model")
rng = random.Random(0)
with open(f"{out}/data.jsonl", "w") as f:
    for _ in range(64):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        f.write(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n")
with open(f"{out}/reward.py", "w") as f:
    f.write('''import torch

def reward_func(queries, prompts, labels):
    # share of the label's characters present right after "=" (graded, so groups have variance)
    out = []
    for q, label in zip(queries, labels):
        ans = q.split("=", 1)[-1]
        out.append(sum(a == b for a, b in zip(ans, label)) / max(len(label), 1))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {}}
''')
print("model, data, reward in", out)
EOF

COMMON=(
  --actor.model_name_or_path "$OUT/model" --actor.num_nodes 1 --actor.num_gpus_per_node 1
  --ref.num_nodes 1 --ref.num_gpus_per_node 1
  --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.2 --vllm.enforce_eager
  --train.colocate_all
  --data.prompt_dataset "$OUT/data.jsonl" --data.input_key input --data.label_key label --data.input_template "{}"
  --data.max_samples 32 --data.max_len 64 --rollout.max_new_tokens 12
  --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --rollout.micro_batch_size 4
  --train.batch_size 16 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1 --train.seed 0
  --algo.advantage.estimator group_norm --algo.kl.use_loss --algo.kl.init_coef 0.001 --algo.kl.estimator k3
  --reward.remote_url "$OUT/reward.py"
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2 --actor.adam.lr 1e-5
)

FILTER=(--grpo_parts.filter cppo --grpo_parts.filter_kwargs '{"pruning_rate": 0.5}' --grpo_parts.refill_rounds 2)
ATTENTION=(--grpo_parts.attention shared_prefix --grpo_parts.check_first_batch 1)
SPECULATIVE=(--grpo_parts.speculative_config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')

set_extra() {  # fills the array `extra` with the --grpo_parts.* flags of configuration $1
  case "$1" in
    baseline) extra=() ;;
    filter) extra=("${FILTER[@]}") ;;
    attention) extra=("${ATTENTION[@]}") ;;
    attention_packed) extra=("${ATTENTION[@]}" --ds.packing_samples) ;;
    speculative) extra=("${SPECULATIVE[@]}") ;;
    all) extra=("${FILTER[@]}" "${ATTENTION[@]}" "${SPECULATIVE[@]}") ;;
    *) echo "unknown config $1" >&2; return 1 ;;
  esac
}

for cfg in "${CONFIGS[@]}"; do
  set_extra "$cfg"
  echo "=== $cfg: ${extra[*]:-(plain OpenRLHF)}"
  start=$(date +%s)
  rc=0
  timeout "$TIMEOUT" "$PY" -m grpo_parts_adapters.openrlhf.launch "${COMMON[@]}" "${extra[@]}" \
    --ckpt.output_dir "$OUT/ckpt_$cfg" --ckpt.path "$OUT/ckpt_$cfg/ds" >"$OUT/$cfg.log" 2>&1 || rc=$?
  echo "$rc" >"$OUT/$cfg.rc"
  echo "    exit $rc after $(( $(date +%s) - start ))s; $(grep -c 'Global step' "$OUT/$cfg.log" || true) step(s) logged"
  [ "$rc" -eq 0 ] || tail -n 15 "$OUT/$cfg.log" | sed 's/^/    /'
  ray stop --force >/dev/null 2>&1 || true
done

META=$("$PY" - <<'EOF'
import json, torch, vllm, deepspeed, openrlhf, transformers
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__,
                  "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                  "openrlhf": getattr(openrlhf, "__version__", "0.11.2")}))
EOF
)
"$PY" "$REPO/scripts/gpu/openrlhf_smoke_check.py" "$OUT" "${CONFIGS[@]}" --json "$JSON" \
  --logprob-tol "${SMOKE_LOGPROB_TOL:-0.05}" --meta "$META"
