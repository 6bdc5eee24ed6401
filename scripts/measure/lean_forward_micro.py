"""Per-forward time of the lean decode forward: the bench's 24-layer task-policy shape (random
weights, 40 cache columns) and the main job's ``tiny_reasoner`` (280 columns), 1 and 16 rows x 1 and
7 tokens, median of 40, 2 threads (docs/history/benchmarks-log.md, "Lean decode forwards").

    python scripts/measure/lean_forward_micro.py      # run alone; for an A/B set PYTHONPATH to each tree
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from grpo_parts.compat import crop_cache, output_cache
from grpo_parts.sampler.speculative.lean_forward import LeanForward
from grpo_parts.tiny import tiny_causal_lm

REASONER = Path(__file__).resolve().parents[2] / "src" / "grpo_parts" / "assets" / "tiny_reasoner"


def models() -> dict[str, torch.nn.Module]:
    """The bench's 24-layer task-policy shape (random weights) and the committed ``tiny_reasoner``."""
    from transformers import AutoModelForCausalLM  # here, not at the top: --help stays quick

    bench24 = tiny_causal_lm(
        "qwen2",
        vocab_size=21,
        hidden_size=256,
        num_layers=24,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        seed=0,
    )
    return {"bench24": bench24, "reasoner": AutoModelForCausalLM.from_pretrained(REASONER).eval()}


def median_ms(m: torch.nn.Module, lean: LeanForward, rows: int, tokens: int, columns: int) -> float:
    """Median of 40 lean forwards of ``rows`` x ``tokens`` on a ``columns``-long cache, in ms."""
    ids = torch.randint(2, 21, (rows, columns))
    with torch.inference_mode():
        cache = output_cache(m(input_ids=ids, use_cache=True))
        mask = torch.ones(rows, columns + tokens, dtype=torch.long)
        pos = torch.arange(columns, columns + tokens)[None].expand(rows, -1)
        inp = torch.randint(2, 21, (rows, tokens))
        ts = []
        for _ in range(40):
            t0 = time.perf_counter()
            lean(inp, mask, pos, cache)
            ts.append(time.perf_counter() - t0)
            crop_cache(cache, columns)
    ts.sort()
    return 1000 * ts[len(ts) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = []
    for name, m in models().items():
        lean = LeanForward(m)
        columns = 40 if name == "bench24" else 280
        for rows, tokens in ((1, 1), (1, 7), (16, 1), (16, 7)):
            out.append(f"{name} {rows}x{tokens}: {median_ms(m, lean, rows, tokens, columns):.3f}")
    print(" | ".join(out))


if __name__ == "__main__":
    main()
