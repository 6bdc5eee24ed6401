"""Per-forward time of the lean decode forward (docs/benchmarks.md, "Lean decode forwards"): the
bench's 24-layer task-policy shape (random weights, 40 cache columns) and the main job's
``tiny_reasoner`` (280 columns), 1 and 16 rows x 1 and 7 tokens, median of 40, 2 threads.

    python scripts/lean_forward_micro.py      # run alone; for an A/B set PYTHONPATH to each tree
"""

from __future__ import annotations

import os
import time

import torch
from transformers import AutoModelForCausalLM

from grpo_parts.compat import crop_cache, output_cache
from grpo_parts.sampler.speculative.lean_forward import LeanForward
from grpo_parts.tiny import tiny_causal_lm

torch.set_num_threads(2)
models = {
    "bench24": tiny_causal_lm(
        "qwen2",
        vocab_size=21,
        hidden_size=256,
        num_layers=24,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        seed=0,
    ),
    "reasoner": AutoModelForCausalLM.from_pretrained(
        os.path.join(os.path.dirname(__file__), "..", "src", "grpo_parts", "assets", "tiny_reasoner")
    ).eval(),
}
out = []
for name, m in models.items():
    lean = LeanForward(m)
    L = 40 if name == "bench24" else 280
    for B, T in ((1, 1), (1, 7), (16, 1), (16, 7)):
        ids = torch.randint(2, 21, (B, L))
        with torch.inference_mode():
            cache = output_cache(m(input_ids=ids, use_cache=True))
            mask = torch.ones(B, L + T, dtype=torch.long)
            pos = torch.arange(L, L + T)[None].expand(B, -1)
            inp = torch.randint(2, 21, (B, T))
            ts = []
            for _ in range(40):
                t0 = time.perf_counter()
                lean(inp, mask, pos, cache)
                ts.append(time.perf_counter() - t0)
                crop_cache(cache, L)
        ts.sort()
        out.append(f"{name} {B}x{T}: {1000 * ts[len(ts) // 2]:.3f}")
print(" | ".join(out))
