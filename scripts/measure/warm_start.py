"""Warm start for the built-in task: a tiny policy that can do the work but has a bad habit.

GRPO needs a nonzero reward to learn from, and on a CPU it has minutes, not hours -- enough to make
a policy reliable at something it can already do (what RL mostly does to LLMs), not to teach it
arithmetic from scratch. So the committed policy is made by SFT (next-token cross-entropy on worked
solutions, loss on the completion only) in three stages:

1. **skill, fast** -- clean worked solutions at ``--lr`` until greedy held-out accuracy >= ``--warm-until``;
2. **skill, slow** -- a fresh optimizer at ``--lr2``, the problem stream restarted, until >= ``--skill-until``;
3. **habit** -- (same optimizer) solutions whose final answer is, with probability ``--habit-rate``, the
   *first* partial sum instead of the total (answering with an intermediate result), until greedy
   held-out accuracy falls to ``--stop-at`` or below (after at least ``--habit-min-steps`` steps).

The policy then answers right only a few times in a hundred when sampling and ~10% of the time when
greedy; the reward is exact match on the final answer, so GRPO has a clear signal and most of the way
to go. The result is a transformers checkpoint folder (config.json, model.safetensors, tokenizer
files) under ``src/grpo_parts/assets/tiny_adder``; ``grpo-parts train`` loads it like any ``--model``.
The policy trains as a qwen2 and is saved as the same function in a llama folder
(:func:`grpo_parts.tiny.qwen2_as_llama`, bit-identical logits), so ``AutoTokenizer`` keeps its tokenizer.

    python scripts/measure/warm_start.py     # ~12 min on a busy 2-core CPU; 1 thread, deterministic: on the project's
                                     # machine it reproduces the committed model.safetensors bit for bit

``--task reasoning`` makes ``assets/tiny_reasoner`` for the reasoning-shaped task (same shape, 512
positions, a character tokenizer with letters; long and short rows in separate forwards):

    python scripts/measure/warm_start.py --task reasoning --skill-until 0.65   # ~14 min on a 2-core CPU under load
    # (committed run: skill 0.21 at step 100, 0.74 at stage-2 step 150; habit to 0.035 in 60 steps)
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from grpo_parts.bench.draft_training import padded_rows
from grpo_parts.compat import portable_tokenizer_config
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.task.arithmetic import ArithmeticConfig, ArithmeticTask
from grpo_parts.task.data import Problem, eval_accuracy
from grpo_parts.task.reasoning import CHARS as REASONING_CHARS
from grpo_parts.task.reasoning import ReasoningConfig, ReasoningTask
from grpo_parts.task.tokenizer import CHARS, EOS_ID, PAD_ID, build_hf_tokenizer
from grpo_parts.tiny import qwen2_as_llama, tiny_causal_lm

ASSETS = Path(__file__).resolve().parents[2] / "src" / "grpo_parts" / "assets"
#: task -> (output folder, tokenizer characters, max positions, eval max_new_tokens, default lr)
TASKS: dict[str, tuple[str, str, int, int]] = {
    "arithmetic": ("tiny_adder", CHARS, 64, 28),
    "reasoning": ("tiny_reasoner", REASONING_CHARS, 512, 320),
}


def first_partial_sum(task: Any, work: str) -> str:
    """The first intermediate result of a worked solution (the bad habit's answer)."""
    if task.name == "reasoning":  # "8+2+7=10+7=17" -> "8"
        return work.split("=", 1)[0].split("+", 1)[0]
    return work.split(",", 1)[0].rsplit("=", 1)[1]  # "17+25=42,42+9=51" -> "42"


def habit_target(task: Any, p: Problem, rng: random.Random, rate: float) -> str:
    """The worked solution; with probability ``rate`` its final answer is the first partial sum."""
    text = task.sft_target(p)
    if rng.random() >= rate:
        return text
    work = text.rsplit(";", 1)[0]
    return f"{work};{first_partial_sum(task, work)}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="arithmetic", help="built-in task to warm-start")
    ap.add_argument("--out", type=Path, help="output folder (default: the task's folder under assets/)")
    ap.add_argument("--lr", type=float, default=2e-3, help="stage-1 learning rate")
    ap.add_argument("--warm-until", type=float, default=0.2, help="stage 1 ends at this held-out accuracy")
    ap.add_argument("--lr2", type=float, default=1e-3, help="stage-2 and -3 learning rate")
    ap.add_argument("--skill-until", type=float, default=0.7, help="stage 2 ends at this held-out accuracy")
    ap.add_argument("--max-steps", type=int, default=3000, help="upper bound on the steps of stages 1 and 2")
    ap.add_argument(
        "--habit-rate",
        type=float,
        default=0.7,
        help="stage 3: share of targets answering the first partial sum",
    )
    ap.add_argument("--habit-min-steps", type=int, default=60, help="stage 3 runs at least this many steps")
    ap.add_argument("--stop-at", type=float, default=0.15, help="stage 3 ends at this accuracy or below")
    ap.add_argument("--batch", type=int, default=64, help="SFT problems per step")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model, the problem stream and the habit")
    ap.add_argument("--max-digit", type=int, help="reasoning: largest term (default: the task's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)")
    return ap.parse_args()


def make_task(args: argparse.Namespace) -> Any:
    """The task's SFT problem stream: a different one than GRPO's (seed offset 10,000)."""
    if args.task == "reasoning":
        cfg = ReasoningConfig(**({"max_digit": args.max_digit} if args.max_digit else {}))
        return ReasoningTask(cfg, seed=10_000 + args.seed)
    return ArithmeticTask(ArithmeticConfig(), seed=10_000 + args.seed)


def make_model(args: argparse.Namespace, vocab_size: int, max_pos: int) -> torch.nn.Module:
    """The tiny qwen2 policy (4 layers, width 128), randomly initialized from ``--seed``."""
    return tiny_causal_lm(
        "qwen2", vocab_size=vocab_size, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384,
        max_position_embeddings=max_pos, seed=args.seed, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )  # fmt: skip


def length_buckets(
    rows: list[tuple[list[int], list[int]]], split: bool
) -> list[list[tuple[list[int], list[int]]]]:
    """With ``split`` (reasoning), long and short rows apart: less padding, same token-mean loss."""
    if not split:
        return [rows]
    cut = 2 * sorted(len(b) for _, b in rows)[len(rows) // 2]
    return [[r for r in rows if len(r[1]) <= cut], [r for r in rows if len(r[1]) > cut]]


class SFTRun:
    """One warm start's state: the model, its task and tokenizer, the optimizer and the problem
    stream (position and the habit's random draws)."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, task: Any, tok: Any, max_new: int):
        self.args, self.model, self.task, self.tok = args, model, task, tok
        self.evals = task.eval_problems()[:200]
        self.params = SamplingParams(
            max_new_tokens=max_new, temperature=0.0, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID
        )
        self.t0 = time.perf_counter()
        self.opt: torch.optim.Optimizer | None = None
        self.lr, self.pos, self.rng = 0.0, 0, random.Random(args.seed)

    def restart(self, lr: float) -> None:
        """A fresh optimizer (warmup again) and the problem stream from its start."""
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.lr, self.pos, self.rng = lr, 0, random.Random(self.args.seed)

    def rows(self, rate: float) -> list[tuple[list[int], list[int]]]:
        """The next ``--batch`` problems as (prompt, target + EOS) token rows."""
        out = []
        for _ in range(self.args.batch):
            p = self.task.train_problem(self.pos)
            self.pos += 1
            target = habit_target(self.task, p, self.rng, rate)
            out.append((self.tok.encode(p.prompt), self.tok.encode(target) + [EOS_ID]))
        return out

    def step(self, step: int, rate: float) -> float:
        """One SFT step (learning rate warmed up over 100 steps); the loss."""
        self.model.train()
        rows = self.rows(rate)
        assert self.opt is not None, "restart() first"
        for g in self.opt.param_groups:
            g["lr"] = self.lr * min(1.0, step / 100)
        buckets = length_buckets(rows, self.args.task == "reasoning")
        total = sum(len(b) for _, b in rows)
        loss = torch.zeros(())
        for bucket in (b for b in buckets if b):
            ids, labels, mask = padded_rows(bucket, PAD_ID)  # right padding, loss on the completion only
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss = loss + out * (sum(len(b) for _, b in bucket) / total if len(buckets) > 1 else 1.0)
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())

    def evaluate(self, tag: str, step: int, loss: float) -> float:
        """Greedy held-out accuracy on 200 eval problems (printed)."""
        self.model.eval()
        acc = eval_accuracy(ReferenceSampler(self.model), self.task, self.evals, self.tok, self.params)
        elapsed = time.perf_counter() - self.t0
        print(f"{tag} step {step} loss {loss:.3f} greedy held-out acc {acc:.3f} ({elapsed:.0f}s)")
        return acc


def train_skill(run: SFTRun) -> int:
    """Stages 1 and 2 (clean solutions, each from a fresh optimizer); the last step's number."""
    args, step = run.args, 0
    for stage, lr, until in (
        ("skill-fast", args.lr, args.warm_until),
        ("skill-slow", args.lr2, args.skill_until),
    ):
        run.restart(lr)
        for step in range(1, args.max_steps + 1):
            loss = run.step(step, 0.0)
            if step % 50 == 0 and run.evaluate(stage, step, loss) >= until:
                break
    return step


def train_habit(run: SFTRun, step: int) -> None:
    """Stage 3: same optimizer and stream, the step count (warmup) continues from ``step``."""
    args = run.args
    for h in range(1, 10_000):
        loss = run.step(step + h, args.habit_rate)
        if h % 20 == 0 and h >= args.habit_min_steps and run.evaluate("habit", h, loss) <= args.stop_at:
            break


def save(model: torch.nn.Module, tok: Any, out: Path) -> None:
    """Trained as qwen2, shipped as the same function in a llama folder: AutoTokenizer (transformers 5)
    ignores the declared tokenizer class of qwen2 folders and drops the character tokenizer's spaces."""
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    qwen2_as_llama(model).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    portable_tokenizer_config(out)  # loadable by transformers 4.x too
    print(f"saved {out}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder, chars, max_pos, max_new = TASKS[args.task]
    tok = build_hf_tokenizer(chars)
    task = make_task(args)
    model = make_model(args, len(tok), max_pos)
    print(f"policy: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    run = SFTRun(args, model, task, tok, max_new)
    train_habit(run, train_skill(run))
    save(model, tok, args.out or ASSETS / folder)


if __name__ == "__main__":
    main()
