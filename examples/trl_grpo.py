"""GRPO with TRL 1.16's GRPOTrainer and grpo_parts' parts, on CPU in about a minute.

A tiny Qwen2 (random init, built from a config) learns to answer with vowels: the reward is the
fraction of vowels in the completion. Everything is offline: the tokenizer is built with
``tokenizers``, the dataset is in memory.

    python examples/trl_grpo.py                       # all parts on (see --help for each switch)
    python examples/trl_grpo.py --plain               # stock GRPOTrainer, for comparison
    python examples/trl_grpo.py --filter none --attention reference --jsonl /tmp/run.jsonl

The only lines a TRL user adds are in ``build_trainer``: ``GRPOPartsTrainer`` instead of
``GRPOTrainer`` plus the part switches.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

VOWELS = set("aeiou")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {c: 3 + i for i, c in enumerate(LETTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def vowel_reward(completions: list[str], **kwargs: Any) -> list[float]:
    words = [c.split() for c in completions]
    return [sum(w in VOWELS for w in ws) / max(len(ws), 1) for ws in words]


def build_dataset(n: int, seed: int) -> Any:
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def build_trainer(args: argparse.Namespace) -> Any:
    from grpo_parts_adapters.trl import GRPOPartsTrainer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_parts.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen2", vocab_size=32, hidden_size=64, num_layers=2, seed=args.seed)
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.prompts_per_step * args.group_size // 2,
        gradient_accumulation_steps=2,
        num_generations=args.group_size,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
    )
    common = dict(
        model=model,
        reward_funcs=vowel_reward,
        args=config,
        train_dataset=build_dataset(256, args.seed),
        processing_class=build_tokenizer(),
    )
    if args.plain:
        return GRPOTrainer(**common)

    parts: dict[str, Any] = {}
    if args.sampler == "speculative":
        parts.update(sampler="speculative", draft=args.draft)  # built on the trainer's policy
    elif args.sampler != "none":
        parts["sampler"] = args.sampler
    if args.attention != "none":
        parts["attention"] = args.attention
    if args.filter != "none":
        parts["filter"] = args.filter
        if args.filter == "cppo":
            parts["filter_kwargs"] = {"pruning_rate": args.pruning_rate}
    # --- the lines a TRL user adds: GRPOPartsTrainer instead of GRPOTrainer, plus the parts ---
    return GRPOPartsTrainer(**common, **parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--plain", action="store_true", help="stock GRPOTrainer (no parts)")
    p.add_argument("--sampler", default="speculative", choices=["none", "reference", "speculative"])
    p.add_argument(
        "--draft", default="ngram", choices=["ngram", "eagle"], help="draft of the speculative sampler"
    )
    p.add_argument("--attention", default="shared_prefix", choices=["none", "reference", "shared_prefix"])
    p.add_argument("--filter", default="cppo", choices=["none", "keep_all", "cppo", "zero_variance"])
    p.add_argument("--pruning-rate", type=float, default=0.5, help="CPPO: fraction of completions pruned")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="/tmp/grpo_parts_trl_example")
    p.add_argument("--jsonl", default=None, help="write TRL's log history (one JSON object per step) here")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)

    trainer = build_trainer(args)
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    steps = [h for h in trainer.state.log_history if "reward" in h]
    print(f"\n{'step':>4} {'reward':>7} {'loss':>9} {'kept':>5} {'accept/verify':>13}")
    for h in steps:
        kept = h.get("parts/filter/kept_fraction", 1.0)
        acc = h.get("parts/sampler/accepted_per_verify", float("nan"))
        print(f"{h['step']:>4} {h['reward']:>7.3f} {h['loss']:>9.4f} {kept:>5.2f} {acc:>13.2f}")
    print(
        f"{len(steps)} steps in {elapsed:.1f}s; reward {steps[0]['reward']:.3f} -> {steps[-1]['reward']:.3f}"
    )
    # what went through each part and what fell back to TRL's own path, summed over the steps
    counts: dict[str, float] = {}
    for h in trainer.state.log_history:
        for k, v in h.items():
            if k.startswith("parts/") and k.rsplit("/", 1)[1] in (
                "rollouts",
                "forwards",
                "calls",
                "fallbacks",
            ):
                counts[k[len("parts/") :]] = counts.get(k[len("parts/") :], 0.0) + v
    if counts:
        print("what ran: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())))
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for h in trainer.state.log_history:
                f.write(json.dumps(h) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
