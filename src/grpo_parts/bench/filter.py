"""``grpo-parts bench filter``: time of the training phase vs CPPO pruning rate.

Timed: what pruning shrinks -- the old-policy and reference forwards and the policy forward/backward
on the kept rows, in fixed-size micro-batches, plus the filter and
:func:`~grpo_parts.filter.apply.apply_filter`; not rollout, rewards or the optimizer step. ``speedup``
= time(P = 0) / time(P), next to the ideal ``1 / (1 - P)``. The synthetic batch has continuous
rewards, so every group has variance and exactly ``N - floor(P * N)`` rows are kept.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from typing import Any

import torch

from ..errors import GRPOPartsError
from ._args import add_common

DEFAULT_RATES = (0.0, 0.5, 0.75, 0.875)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(
        p, quick="small model and batch, one repeat (smoke test)", summary="the median reported",
        model="model", hidden=256, layers=3, vocab=2048,
    )  # fmt: skip
    p.add_argument(
        "--rates", type=float, nargs="+", default=list(DEFAULT_RATES),
        help="pruning rates P in [0, 1); 0 is always added as the baseline (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (B)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument(
        "--prompt-len", type=int, default=96, help="max prompt tokens (lengths vary in [len/2, len])"
    )
    p.add_argument(
        "--completion-len", type=int, default=128, help="max completion tokens (vary in [len/4, len])"
    )
    p.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward micro-batch")
    p.add_argument("--scope", choices=["global", "group"], default="global", help="top-k scope")


def _batch(args: argparse.Namespace, gen: torch.Generator) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from grpo_parts.core import group_advantages
    from grpo_parts.types import Rollout

    b, g = args.prompts, args.group_size
    n, pl, tl = b * g, args.prompt_len, args.completion_len
    p_len = torch.randint(max(1, pl // 2), pl + 1, (b,), generator=gen).repeat_interleave(g)
    prompt_mask = (torch.arange(pl) >= pl - p_len[:, None]).long()
    prompt_ids = torch.randint(1, args.vocab, (b, pl), generator=gen).repeat_interleave(g, 0) * prompt_mask
    c_len = torch.randint(max(1, tl // 4), tl + 1, (n,), generator=gen)
    completion_mask = (torch.arange(tl) < c_len[:, None]).long()
    completion_ids = torch.randint(1, args.vocab, (n, tl), generator=gen) * completion_mask
    group_index = torch.arange(b).repeat_interleave(g)
    rollout = Rollout(
        prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(n, tl), group_index, b
    )
    rewards = torch.rand(n, generator=gen)
    return rollout, rewards, group_advantages(rewards, group_index)


def _training_phase(
    filt: Any,
    rollout: Any,
    rewards: torch.Tensor,
    adv: torch.Tensor,
    policy: torch.nn.Module,
    ref: torch.nn.Module,
    micro: int,
) -> tuple[float, float, int, float]:
    from grpo_parts.attention.protocol import LogprobBatch
    from grpo_parts.attention.reference import RepeatedPrefixAttention
    from grpo_parts.core import LossConfig, grpo_loss
    from grpo_parts.filter.apply import apply_filter
    from grpo_parts.types import ScoredBatch

    backend, cfg = RepeatedPrefixAttention(), LossConfig(kl_coef=0.04)
    policy.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    res = filt.select(ScoredBatch(rewards, adv, rollout.group_index))
    kb = apply_filter(res, rollout, adv)
    if kb.is_empty:
        return time.perf_counter() - t0, time.process_time() - c0, 0, 0.0
    kept = kb.rollout
    assert kept is not None
    micro_batches = [torch.arange(i, min(i + micro, kb.size)) for i in range(0, kb.size, micro)]

    def logprobs(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return backend.completion_logprobs(model, LogprobBatch.from_rollout(kept.select(rows))).logprobs

    with torch.no_grad():  # old-policy and reference forwards on the kept rows only
        old = torch.cat([logprobs(policy, c) for c in micro_batches])
        refl = torch.cat([logprobs(ref, c) for c in micro_batches])
    for c in micro_batches:
        out = grpo_loss(
            logprobs(policy, c), old[c], kb.advantages[c], kept.completion_mask[c], cfg, refl[c],
            num_tokens=kb.num_tokens, num_seqs=kb.num_seqs,
        )  # fmt: skip
        out.loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0, kb.size, kb.num_tokens


def amdahl(train_speedup: float, rollout_fraction: float) -> float:
    """End-to-end step speedup when only the training phase (1 - rollout_fraction of the step,
    ignoring 'everything else') gets faster by ``train_speedup``: ``1 / (f_r + (1 - f_r) / s)``."""
    return 1.0 / (rollout_fraction + (1.0 - rollout_fraction) / train_speedup)


def _resolve_options(args: argparse.Namespace) -> None:
    """``--quick`` sizes, the P = 0 baseline added to ``--rates`` (checked), ``--threads``."""
    if args.quick:
        args.prompts, args.group_size, args.prompt_len, args.completion_len = 8, 8, 48, 64
        args.hidden, args.layers, args.vocab, args.repeats = 128, 2, 1024, 1
    if 0.0 not in args.rates:
        args.rates = [0.0, *args.rates]
    if any(not 0.0 <= p < 1.0 for p in args.rates):
        raise GRPOPartsError(f"--rates: expected values in [0, 1), got {args.rates}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)


def _policy_and_ref(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny qwen2 policy (training mode) and a frozen copy as the reference model."""
    from grpo_parts.tiny import tiny_causal_lm

    heads = max(1, args.hidden // 64)
    policy = tiny_causal_lm(
        "qwen2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
        num_kv_heads=max(1, heads // 2), intermediate_size=args.hidden * 3, seed=args.seed,
    )  # fmt: skip
    policy.train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, ref


def _time_rates(
    args: argparse.Namespace,
    rollout: Any,
    rewards: torch.Tensor,
    adv: torch.Tensor,
    policy: torch.nn.Module,
    ref: torch.nn.Module,
) -> tuple[dict[float, list[float]], dict[float, list[float]], dict[float, int], dict[float, float]]:
    """``(wall seconds, cpu seconds, kept rows, kept completion tokens)`` per pruning rate, the
    times one per repeat, after one warm-up."""
    from tqdm import tqdm

    from grpo_parts.filter.cppo import TopKAbsAdvantage
    from grpo_parts.filter.reference import KeepAll

    filters = {
        p: KeepAll() if p == 0.0 else TopKAbsAdvantage(pruning_rate=p, scope=args.scope) for p in args.rates
    }
    times: dict[float, list[float]] = {p: [] for p in args.rates}
    cpu: dict[float, list[float]] = {p: [] for p in args.rates}
    kept: dict[float, int] = {}
    kept_tokens: dict[float, float] = {}
    _training_phase(filters[args.rates[-1]], rollout, rewards, adv, policy, ref, args.micro_batch)  # warm-up
    # interleave rates within each repeat so machine-load drift hits every point alike
    for _ in tqdm(range(args.repeats), desc="bench filter", unit="repeat"):
        for p in args.rates:
            t, c, k, tok = _training_phase(filters[p], rollout, rewards, adv, policy, ref, args.micro_batch)
            times[p].append(t)
            cpu[p].append(c)
            kept[p], kept_tokens[p] = k, tok
    return times, cpu, kept, kept_tokens


def _points(
    args: argparse.Namespace,
    n: int,
    times: dict[float, list[float]],
    cpu: dict[float, list[float]],
    kept: dict[float, int],
    kept_tokens: dict[float, float],
) -> list[dict[str, Any]]:
    """One result per pruning rate: medians, speedup over P = 0 on ``--clock``, and the ideals."""
    clock = times if args.clock == "wall" else cpu
    base = statistics.median(clock[0.0])
    points = []
    for p in args.rates:
        t = statistics.median(clock[p])
        points.append(
            {
                "pruning_rate": p,
                "speedup": base / t,
                "ideal": 1.0 / (1.0 - p),
                "ideal_completion_tokens": kept_tokens[0.0] / kept_tokens[p] if kept[p] else float("inf"),
                "fraction_of_ideal": (base / t) * (1.0 - p),
                "seconds": statistics.median(times[p]),
                "cpu_seconds": statistics.median(cpu[p]),
                "clock": args.clock,
                "kept_rows": kept[p],
                "kept_completion_tokens": kept_tokens[p],
                "rows": n,
                "step_speedup_rollout_65pct": amdahl(base / t, 0.65),
                "step_speedup_rollout_90pct": amdahl(base / t, 0.90),
            }
        )
    return points


def _print_points(args: argparse.Namespace, points: list[dict[str, Any]]) -> None:
    print(
        f"qwen2 tiny: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; B={args.prompts} x "
        f"G={args.group_size}; prompt <= {args.prompt_len}, completion <= {args.completion_len} tokens; "
        f"micro-batch {args.micro_batch}; scope {args.scope}; {args.repeats} repeats (median, {args.clock} clock); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}"
    )
    print(
        f"{'P':>7} {'kept':>5} {'wall s':>8} {'cpu s':>8} {'speedup':>8} {'ideal':>6} {'of ideal':>8} {'step@65%':>8}"
    )
    for pt in points:
        print(
            f"{pt['pruning_rate']:>7.4g} {pt['kept_rows']:>5d} {pt['seconds']:>8.3f} {pt['cpu_seconds']:>8.3f} "
            f"{pt['speedup']:>8.2f} "
            f"{pt['ideal']:>6.2f} {pt['fraction_of_ideal']:>8.2f} {pt['step_speedup_rollout_65pct']:>8.2f}"
        )


def run(args: argparse.Namespace) -> int:
    _resolve_options(args)
    torch.manual_seed(args.seed)
    policy, ref = _policy_and_ref(args)
    rollout, rewards, adv = _batch(args, torch.Generator().manual_seed(args.seed))
    times, cpu, kept, kept_tokens = _time_rates(args, rollout, rewards, adv, policy, ref)
    points = _points(args, rollout.num_completions, times, cpu, kept, kept_tokens)
    _print_points(args, points)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(points, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
