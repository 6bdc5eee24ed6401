#!/usr/bin/env python
"""One attention call of the padding-free layout, forward + backward, on CPU: the varlen cascade
(``attention/shared_prefix/varlen.py``, the ``sdpa`` kernel's default) vs the dense masked SDPA per span
(``varlen=False``), or with ``--kernel eager`` the eager kernel's varlen plan
(``attention/shared_prefix/varlen_eager.py``) vs the dense eager span mask; interleaved in one process, ratio per
case (docs/history/benchmarks-log.md, "Varlen cascade").

    python scripts/measure/varlen_attention_bench.py --threads 1 --repeats 5 [--kernel eager] [--json]

Cases: one span (one prompt) of G completions with long-tailed lengths as
``scripts/measure/verl_prefix_bench.py --long-tail`` draws them (seed 0), layer-shaped q/k/v in float32
(``--heads 8 --kv-heads 2``, head size ``--head-dim``). The plan and masks are built once (a
forward builds them on its first layer and reuses them in the others) and timed separately.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_prefix_bench import long_tail_length  # noqa: E402

from grpo_parts.attention.shared_prefix.padding_free import PaddingFreeLayout, padding_free_attention  # noqa: E402
from grpo_parts.attention.shared_prefix.varlen import varlen_plan  # noqa: E402
from grpo_parts.attention.shared_prefix.varlen_eager import eager_scores  # noqa: E402


def layout(prefix: int, lengths: list[int], kernel: str = "sdpa") -> PaddingFreeLayout:
    sid = [0] * prefix + [j + 1 for j, n in enumerate(lengths) for _ in range(n)]
    return PaddingFreeLayout(len(sid), ((0, len(sid)),), torch.tensor(sid), len(sid), kernel)


def one(
    lay: PaddingFreeLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None
) -> float:
    t = time.perf_counter()
    out = padding_free_attention(q, k, v, lay, q.shape[-1] ** -0.5, softcap, None)
    out.sum().backward()
    return time.perf_counter() - t


def case(g: int, prefix: int, median: int, args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(0)
    lengths = [long_tail_length(median, first=j == 0, g=gen) for j in range(g)]
    lay = layout(prefix, lengths, args.kernel)
    t = time.perf_counter()
    plan = varlen_plan(lay.spans, lay.suffix_id)
    plan_s = time.perf_counter() - t
    shape = (1, args.heads, lay.row_len, args.head_dim)
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn((1, args.kv_heads, *shape[2:]), requires_grad=True)
    v = torch.randn((1, args.kv_heads, *shape[2:]), requires_grad=True)
    lays = {
        name: dataclasses.replace(lay, varlen=name == "varlen", masks=type(lay.masks)())
        for name in ("varlen", "masked")
    }
    times: dict[str, list[float]] = {name: [] for name in lays}
    for i in range(args.repeats + 1):  # the first round warms up (and builds the masks / plan)
        for name, lay_ in lays.items():
            dt = one(lay_, q, k, v, args.softcap)
            if i:
                times[name].append(dt)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    n = lay.row_len
    return {
        "G": g, "P": prefix, "median_S": statistics.median(lengths), "max_S": max(lengths), "row_len": n,
        "buckets": len(plan.buckets), "scores_masked": n * n,
        "scores_varlen": eager_scores(plan) if args.kernel == "eager" else plan.scores,
        "plan_s": plan_s, "varlen_s": med["varlen"], "masked_s": med["masked"],
        "speedup": med["masked"] / med["varlen"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed calls per case and arm; the median is kept (default: 5)"
    )
    p.add_argument("--heads", type=int, default=8, help="query heads (default: 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: 2)")
    p.add_argument(
        "--head-dim",
        type=int,
        nargs="+",
        default=[8, 64],
        help="head sizes, one table block each (default: 8 64)",
    )
    p.add_argument(
        "--kernel",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="which kernel's varlen plan (default: sdpa)",
    )
    p.add_argument("--softcap", type=float, default=None, help="attention logit soft-capping (eager)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        "| head dim | G | P | median S | max S | buckets | scores varlen / masked | varlen s | masked s | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in args.head_dim:
        args.head_dim = d
        for g, prefix, median in ((16, 64, 128), (16, 1024, 48), (8, 256, 48)):
            r = {"kernel": args.kernel, "head_dim": d, **case(g, prefix, median, args)}
            rows.append(r)
            print(
                f"| {d} | {g} | {prefix} | {r['median_S']:.0f} | {r['max_S']} | {r['buckets']} | "
                f"{r['scores_varlen'] / r['scores_masked']:.2f} | {r['varlen_s'] * 1e3:.1f} ms | "
                f"{r['masked_s'] * 1e3:.1f} ms | {r['speedup']:.2f}x |",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
