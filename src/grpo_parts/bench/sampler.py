"""``grpo-parts bench sampler``: tokens/s of samplers vs the reference sampler and transformers ``generate``.

Every sampler runs on the same policy, prompts and settings. A random policy has no EOS (every row
emits ``max_new_tokens``); ``--policy task`` rows stop at the task's EOS, as in training (text past
EOS is out of distribution, so forcing it would measure nothing real).

Adding a sampler: a factory ``(policy, args) -> list[BenchSampler]`` in :data:`FACTORIES`; rows whose
factory raises ``ImportError`` / ``NotSupportedError`` are skipped with a note. JSON (``--json``):
``{"setup": {...}, "points": [...]}``, a point per row as :func:`_row_point` and
:func:`_measure_point` build it (``speedup``: vs the reference sampler, same batch and mode).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from ..draft import IMPLEMENTATIONS as DRAFTS
from ..errors import GRPOPartsError
from ..sampler.protocol import PromptBatch, Rollout, SamplingParams
from ..sampler.stats import ACCEPTED_PER_VERIFY, SAMPLED_TREE_STEPS, TREE_STEPS, VERIFY_STEPS
from ._args import add_common, ints, names
from ._sampler_models import (
    GenerateSampler,
    bench_prompts,
    cache_load,
    cache_save,
    eos_kwargs,
    make_policy,
    policy_key,
    task_draft,
)


@dataclass
class BenchSampler:
    """One row of the benchmark: a sampler (anything with the ``Sampler.generate`` signature)."""

    name: str
    sampler: Any
    draft: str | None = None
    shape: str | None = None  # speculative rows: "chains" or "trees"


def _reference(policy: torch.nn.Module, args: argparse.Namespace) -> list[BenchSampler]:
    from ..sampler.reference import ReferenceSampler

    return [BenchSampler("reference", ReferenceSampler(policy))]


def _generate(policy: torch.nn.Module, args: argparse.Namespace) -> list[BenchSampler]:
    return [BenchSampler("generate", GenerateSampler(policy))]


def _speculative(policy: torch.nn.Module, args: argparse.Namespace) -> list[BenchSampler]:
    """One row per ``--spec-drafts`` entry. Learnable drafts are first distilled offline on
    ``--spec-text-batches`` batches of task text (``--policy task`` only, as EAGLE heads are trained
    before deployment), then on ``--spec-warmup`` rollouts of the policy (other prompts), then frozen
    while timed. With ``--policy task`` the ``frozen_lm`` and ``small_lm`` drafts are the same 2-layer
    LM of half the policy's width SFT-trained on the task like the policy (a random one would accept
    nothing): ``frozen_lm`` re-encodes its context per token, ``small_lm`` keeps a KV cache."""
    from ..sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    from .draft_training import make_draft

    out = []
    for name in args.spec_drafts.split(","):
        small = name in ("frozen_lm", "small_lm") and args.policy == "task"
        draft = task_draft(policy, args, name) if small else None
        draft = draft or make_draft(name, policy, args.seed)
        if draft.learnable:
            _distil(name, draft, policy, args)
        for shape in args.spec_shapes.split(","):
            trees = args.spec_max_tree if shape == "trees" else 0
            cfg = SpeculativeConfig(
                max_draft_tokens=args.spec_max_draft, max_tree_nodes=trees, train_draft=False
            )
            sampler = SpeculativeSampler(policy, draft, cfg)
            if shape == "trees" and sampler.tree_reasons():
                print(f"skipping {name} trees: {'; '.join(sampler.tree_reasons())}")
                continue
            out.append(BenchSampler("speculative", sampler, draft=name, shape=shape))
    return out


def _distil(name: str, draft: Any, policy: torch.nn.Module, args: argparse.Namespace) -> None:
    """Train a learnable draft as :func:`_speculative` says, or load it from the bench cache."""
    from .draft_training import distill_on_text, warm_up

    key = f"eagle_{policy_key(args)}_text{args.spec_text_batches}_warm{args.spec_warmup}"
    state = cache_load(args, key)
    if state is not None:
        draft.load_state_dict(state)
        print(f"{name}: loaded from the bench cache ({key})")
        return
    if args.policy == "task" and args.spec_text_batches > 0:
        t0 = time.perf_counter()
        losses = distill_on_text(draft, policy, args.spec_text_batches, seed=args.seed)
        print(
            f"{name}: distilled on {len(losses)} batches of task text, loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)"
        )
    if args.spec_warmup > 0:
        params = SamplingParams(group_size=4, max_new_tokens=args.max_new_tokens, **eos_kwargs(args))
        rounds = args.spec_warmup
        hist = warm_up(draft, policy, lambda i: bench_prompts(args, 16, 4, 1000 + i), params, rounds)
        print(f"{name}: distilled on {rounds} rollouts, accepted/verify {[round(h, 2) for h in hist]}")
    cache_save(args, key, draft.state_dict())


def _vllm(policy: torch.nn.Module, args: argparse.Namespace) -> list[BenchSampler]:
    """vLLM in-process (``VLLMSampler``) on the same policy; skipped (ImportError) without vllm."""
    from ..sampler.vllm import VLLMConfig, VLLMSampler, vllm_missing_reason

    missing = vllm_missing_reason()
    if missing:
        raise ImportError(missing)
    dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    cfg = VLLMConfig(dtype=dtype, max_model_len=args.prompt_len + args.max_new_tokens + 8, seed=args.seed)
    threads = torch.get_num_threads()
    sampler = VLLMSampler(policy, cfg)
    torch.set_num_threads(threads)  # vLLM's CPU worker drops torch to 1 thread; keep the rows comparable
    return [BenchSampler("vllm", sampler)]


SamplerFactory = Callable[[torch.nn.Module, argparse.Namespace], list[BenchSampler]]
#: name -> factory. "reference" and "generate" are the two yardsticks; others add rows.
FACTORIES: dict[str, SamplerFactory] = {
    "generate": _generate,
    "reference": _reference,
    "speculative": _speculative,
    "vllm": _vllm,
}


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What is generated and how it is timed: samplers, batches, modes, lengths, repeats, clock; the
    policy's size and seed (:func:`._args.add_common`)."""
    add_common(
        p, quick="small run (smoke test): batch 1 and 4, 16 new tokens", summary="the best reported",
        model="policy", hidden=384, layers=6, vocab=8192,
    )  # fmt: skip
    p.add_argument(
        "--batches", default="1,16", type=ints, help="comma-separated batch sizes (rows generated at once)"
    )
    p.add_argument(
        "--samplers", default=",".join(FACTORIES), type=names(FACTORIES),
        help=f"comma-separated, from {', '.join(FACTORIES)} (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--modes", default="greedy,sample", type=names(["greedy", "sample"]),
        help="greedy and/or sample (temperature 1), comma-separated (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per row (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt; others are 50-100%% of it")
    p.add_argument("--group-size", type=int, default=1, help="completions per prompt (batch = prompts * G)")


def _add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The policy every sampler runs: device, dtype, random or task-trained."""
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available"
    )
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="--policy random: auto = bfloat16 on cuda, float32 on cpu",
    )  # fmt: skip
    p.add_argument(
        "--policy", default="random", choices=["random", "task"],
        help="random weights, or the same architecture SFT-trained on the built-in task (peaked like a trained LM; "
        "prompts from the task, rows stop at EOS)",
    )  # fmt: skip
    p.add_argument("--task-steps", type=int, default=300, help="SFT steps for --policy task")


def _add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """The speculative rows: drafts, draft lengths and trees, draft training, the cache."""
    p.add_argument(
        "--spec-drafts", default="ngram,eagle,small_lm,frozen_lm", type=names(DRAFTS),
        help="drafts of the speculative rows, comma-separated (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--spec-max-draft", type=int, default=6, help="largest draft length the cost model may pick"
    )
    p.add_argument(
        "--spec-warmup", type=int, default=8, help="rollouts a learnable draft is distilled on first"
    )
    p.add_argument(
        "--spec-shapes", default="chains,trees", type=names(["chains", "trees"]),
        help="speculative rows per draft: chains only, and/or trees weighed against chains (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--spec-max-tree", type=int, default=32,
        help="largest draft tree (nodes per row) the cost model may pick",
    )  # fmt: skip
    p.add_argument(
        "--spec-text-batches", type=int, default=150,
        help="--policy task: batches of task text a learnable draft is distilled on before the warm-up rollouts",
    )  # fmt: skip
    p.add_argument(
        "--cache-dir", default="~/.cache/grpo_parts/bench",
        help="--policy task: keep the trained policy and drafts here for re-runs ('' = no cache)",
    )  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    # in this order (``--help`` lists them so)
    _add_workload_arguments(p)
    _add_policy_arguments(p)
    _add_speculative_arguments(p)
    p.add_argument(
        "--prompt-batches", type=int, default=1,
        help="prompt batches per point (times and tokens summed; more = steadier points)",
    )  # fmt: skip


def time_once(
    bs: BenchSampler,
    prompts: PromptBatch,
    params: SamplingParams,
    seed: int,
    device: torch.device,
    clock: str,
) -> tuple[float, Rollout]:
    """Seconds of one ``generate`` call (wall or process CPU time) and its rollout."""
    cuda = device.type == "cuda"
    now = time.perf_counter if clock == "wall" else time.process_time
    torch.manual_seed(seed)  # generate() draws from the global RNG
    gen = torch.Generator(device=device).manual_seed(seed)
    if cuda:
        torch.cuda.synchronize()
    t0 = now()
    rollout = bs.sampler.generate(prompts, params, gen)
    if cuda:
        torch.cuda.synchronize()
    return now() - t0, rollout


def time_samplers(
    rows: list[BenchSampler],
    prompts: PromptBatch,
    params: SamplingParams,
    args: argparse.Namespace,
    device: torch.device,
) -> list[tuple[float, int, Rollout]]:
    """Per row: best time of ``args.repeats`` runs after one warm-up, tokens emitted, last rollout.
    Runs are interleaved round-robin (alternating order) so load changes hit every sampler alike."""
    best = [float("inf")] * len(rows)
    last: list[Rollout | None] = [None] * len(rows)
    for i in range(args.repeats + 1):
        order = list(range(len(rows))) if i % 2 == 0 else list(range(len(rows)))[::-1]
        for j in order:
            dt, last[j] = time_once(rows[j], prompts, params, args.seed, device, args.clock)
            if i > 0:
                best[j] = min(best[j], dt)
    out = []
    for secs, ro in zip(best, last):
        assert ro is not None
        out.append((secs, int(ro.completion_mask.sum()), ro))
    return out


def _bench_rows(policy: torch.nn.Module, args: argparse.Namespace) -> list[BenchSampler]:
    """The rows of ``--samplers``, in order; a factory that cannot run here is skipped with a note."""
    rows: list[BenchSampler] = []
    for name in args.samplers.split(","):  # names checked by --samplers' type
        try:
            rows += FACTORIES[name](policy, args)
        except (ImportError, GRPOPartsError) as e:  # NotSupportedError is a GRPOPartsError
            print(f"skipping {name}: {e}")
    return rows


def _setup(args: argparse.Namespace, policy: torch.nn.Module) -> dict[str, Any]:
    """The JSON ``setup``: the command that reproduces the run, the policy, machine and clock."""
    task = args.policy == "task"
    return {
        "command": "grpo-parts bench sampler "
        + ("--quick" if args.quick else f"--batches {args.batches}")
        + f" --policy {args.policy} --hidden {args.hidden} --layers {args.layers} --samplers {args.samplers}"
        + f" --spec-drafts {args.spec_drafts} --spec-shapes {args.spec_shapes} --max-new-tokens {args.max_new_tokens} --repeats {args.repeats}"
        + f" --prompt-batches {args.prompt_batches}"
        + (f" --task-steps {args.task_steps} --spec-text-batches {args.spec_text_batches}" if task else ""),
        "policy": f"qwen2 tiny_causal_lm hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
        f"params={sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M",
        "device": str(next(policy.parameters()).device),
        "dtype": str(next(policy.parameters()).dtype),
        "machine": f"{platform.machine()} {platform.processor() or ''} torch threads={torch.get_num_threads()}",
        "torch": torch.__version__,
        "clock": f"{args.clock}, best of {args.repeats} interleaved runs after a warm-up, "
        f"summed over {args.prompt_batches} prompt batch(es)",
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
        "group_size": args.group_size,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "policy_kind": f"task ({args.bench_task.name}, {args.task_steps} SFT steps)" if task else args.policy,
    }


def _mode_params(args: argparse.Namespace, mode: str) -> SamplingParams:
    """Sampling settings of ``mode`` (greedy: temperature 0; sample: temperature 1)."""
    return SamplingParams(
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if mode == "greedy" else 1.0,
        **(eos_kwargs(args) if args.policy == "task" else {"pad_token_id": 0}),
    )


def _row_point(
    bs: BenchSampler, results: list[tuple[float, int, Rollout]], batch: int, mode: str
) -> dict[str, Any]:
    """One row's point: times and tokens summed over the prompt batches, speculative stats."""
    secs, toks = sum(x[0] for x in results), sum(x[1] for x in results)
    apv = [x[2].stats[ACCEPTED_PER_VERIFY] for x in results if ACCEPTED_PER_VERIFY in x[2].stats]
    return dict(
        sampler=bs.name,
        draft=bs.draft,
        shape=bs.shape,
        tree_steps=sum(x[2].stats.get(TREE_STEPS, 0.0) for x in results),
        sampled_tree_steps=sum(x[2].stats.get(SAMPLED_TREE_STEPS, 0.0) for x in results),
        verify_steps=sum(x[2].stats.get(VERIFY_STEPS, 0.0) for x in results),
        batch=batch,
        mode=mode,
        tokens_per_s=toks / secs,
        seconds=secs,
        tokens=toks,
        accepted_per_verify=sum(apv) / len(apv) if apv else None,
    )


def _measure_point(
    rows: list[BenchSampler],
    args: argparse.Namespace,
    mode: str,
    params: SamplingParams,
    batch: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Every row at one (mode, batch), over ``--prompt-batches`` prompt batches, with its speedup
    against the reference sampler and ``generate`` (printed as it goes)."""
    per_row: list[list[tuple[float, int, Rollout]]] = [[] for _ in rows]
    for r in range(args.prompt_batches):
        prompts = bench_prompts(args, batch, args.group_size, args.seed + r)
        for i, res in enumerate(time_samplers(rows, prompts, params, args, device)):
            per_row[i].append(res)
    found = [_row_point(bs, results, batch, mode) for bs, results in zip(rows, per_row)]
    ref = next((p["tokens_per_s"] for p in found if p["sampler"] == "reference"), None)
    gen = next((p["tokens_per_s"] for p in found if p["sampler"] == "generate"), None)
    for p in found:
        p["speedup"] = p["tokens_per_s"] / ref if ref else None
        p["ratio_vs_generate"] = p["tokens_per_s"] / gen if gen else None
        print(
            f"{mode:6s} batch={batch:3d} {p['sampler']:>12s} draft={p['draft']!s:10s} {p['shape'] or '':6s} "
            f"{p['tokens_per_s']:9.1f} tok/s  vs reference {_fmt(p['speedup'])}  "
            f"vs generate {_fmt(p['ratio_vs_generate'])}"
        )
    return found


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.batches, args.max_new_tokens, args.repeats, args.prompt_len = "1,4", 16, 1, 16
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    policy = make_policy(args)
    device = next(policy.parameters()).device
    rows = _bench_rows(policy, args)
    setup = _setup(args, policy)
    print(json.dumps(setup, indent=1))
    points: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        params = _mode_params(args, mode)
        for batch in batches:
            points += _measure_point(rows, args, mode, params, batch, device)
    print(f"\n{markdown_table(points)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "points": points}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _fmt(x: float | None) -> str:
    return "   -  " if x is None else f"{x:5.2f}x"


def markdown_table(points: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | batch | sampler | draft | shape | tokens/s | vs reference | vs generate | tokens/verify |",
        "|---|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p['mode']} | {p['batch']} | {p['sampler']} | {p['draft'] or '-'} | {p.get('shape') or '-'} "
            f"| {p['tokens_per_s']:.1f} | {_fmt(p['speedup']).strip()} | {_fmt(p['ratio_vs_generate']).strip()} "
            f"| {'-' if p.get('accepted_per_verify') is None else format(p['accepted_per_verify'], '.2f')} |"
        )
    return "\n".join(lines)
