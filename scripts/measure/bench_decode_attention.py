"""Main-job rollout: reference sampler vs the speculative sampler with the shared-prompt decode
attention off / auto (cost rule) / always, side by side in one process, per phase (forward hooks).

    PYTHONPATH=src python scripts/measure/bench_decode_attention.py [--batches 3]

Step-0 policy of ``grpo-parts train`` (default config), 16 prompts x G, one warm-up batch, then
``--batches`` batches; per batch every sampler gets the same prompts and the same seed. Phases by
active rows: wide (> 64 rows), mid (17-64), tail (<= 16). Prints seconds per sampler and ratios.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import build_trainer
from grpo_parts.train.step.loop import ProblemStream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=3, help="timed batches after the warm-up one (default: 3)")
    args = ap.parse_args()
    tr, _ = build_trainer(load_config(None, {"progress": False}, []))
    stream, spec = ProblemStream(tr), tr.parts.sampler
    rec: list[list[float]] = []
    tr.policy.register_forward_pre_hook(
        lambda m, a, kw: rec.append([kw["input_ids"].shape[0], time.perf_counter()]), with_kwargs=True
    )
    tr.policy.register_forward_hook(lambda m, a, kw, o: rec[-1].append(time.perf_counter()), with_kwargs=True)
    ref = ReferenceSampler(tr.policy)
    modes = ("off", "auto", "always")
    tot: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for it in range(args.batches + 1):
        pb = tr.prompt_batch([next(stream) for _ in range(16)])
        order = ["ref", *(modes if it % 2 else modes[::-1])]
        for name in order:
            s = ref if name == "ref" else spec
            if name != "ref":
                spec.config = spec.config.model_copy(update={"decode_shared_prompt": name})
            rec.clear()
            g = torch.Generator().manual_seed(1000 + it)
            t0 = time.perf_counter()
            out = s.generate(pb, tr.params, g)
            wall = time.perf_counter() - t0
            if it == 0:
                continue
            c = tot[name]
            c["wall"] += wall
            for i, r in enumerate(rec[1:], 1):  # rec[0]: the prefill
                nxt = rec[i + 1][1] if i + 1 < len(rec) else t0 + wall
                phase = "wide" if r[0] > 64 else ("mid" if r[0] > 16 else "tail")
                c[phase] += nxt - r[1]
            c["shared_calls"] += out.stats.get("decode_attention_shared_prefix_calls", 0)
            c["plain_calls"] += out.stats.get("decode_attention_plain_calls", 0)
    print(
        f"torch threads {torch.get_num_threads()}, {args.batches} batches x {len(pb.input_ids)} prompts x G={tr.params.group_size}"
    )
    for name, c in tot.items():
        ratios = {
            k: round(tot["ref"][k] / v, 2) for k, v in c.items() if k in ("wall", "wide", "mid", "tail") and v
        }
        print(name, {k: round(v, 3) for k, v in c.items()}, "ref/this", ratios, flush=True)


if __name__ == "__main__":
    main()
