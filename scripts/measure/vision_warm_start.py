"""Warm start for the built-in vision task: a tiny Qwen2-VL that counts the squares, sometimes.

As for the text tasks (scripts/measure/warm_start.py), GRPO on a CPU has minutes: the committed
policy is made by SFT (cross-entropy on the answer and EOS, given the image and the question) and
stopped as soon as its greedy held-out accuracy reaches ``--until``, so it earns some reward and
GRPO has most of the way to go. The policy is a random ``tiny_vlm("qwen2_vl", ...)`` (its vision
tower trains too); the result is a transformers checkpoint folder (config.json,
generation_config.json, model.safetensors) under ``src/grpo_parts/assets/tiny_counter``. Its
processor is rebuilt from the config (its ``grpo_parts_tiny_processor`` entry:
:func:`grpo_parts.tiny_vision.tiny_processor`), so no files hold it. One torch thread, seeded: the same command writes the same weights on the same machine.

    python scripts/measure/vision_warm_start.py     # well under a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from grpo_parts.attention.vision import row_positions
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.task.data import encode_problems, eval_accuracy
from grpo_parts.task.vision import VisionConfig, VisionTask
from grpo_parts.tiny_vision import TINY_PROCESSOR, tiny_processor, tiny_vlm

ASSETS = Path(__file__).resolve().parents[2] / "src" / "grpo_parts" / "assets"
#: the warm start's shape (grpo_parts.train reads it back from config.json)
SHAPE = dict(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2, vision_layers=2,
             vision_hidden=32)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--until", type=float, default=0.45, help="stop at this greedy held-out accuracy (default 0.45)"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--batch", type=int, default=64, help="problems per SFT step (default 64)")
    p.add_argument("--max-steps", type=int, default=3000, help="give up after this many steps (default 3000)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the problem stream")
    p.add_argument("--out", type=Path, default=ASSETS / "tiny_counter", help="checkpoint folder to write")
    return p.parse_args(argv)


def build_policy(seed: int) -> tuple[torch.nn.Module, object]:
    """The random policy and its processor, EOS and padding the processor's tokenizer's."""
    model = tiny_vlm("qwen2_vl", seed=seed, **SHAPE)  # type: ignore[arg-type]
    processor = tiny_processor(model, max_image_tokens=VisionConfig().image_tokens)
    tok = processor.tokenizer  # type: ignore[attr-defined]
    for cfg in (model.config, model.config.get_text_config(), model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    # loaders rebuild this processor from the config (grpo_parts.train.lifecycle.setup.load_vlm)
    setattr(model.config, TINY_PROCESSOR, {"max_image_tokens": VisionConfig().image_tokens})
    return model, processor


def sft_loss(model: torch.nn.Module, processor: object, problems: list) -> torch.Tensor:
    """Cross-entropy on each problem's answer token and EOS (the prompts' last positions: left-padded)."""
    eos = processor.tokenizer.eos_token  # type: ignore[attr-defined]
    text = [p.prompt + p.answer + eos for p in problems]
    batch = encode_problems(
        processor, [type(p)(t, p.answer, images=p.images) for p, t in zip(problems, text)]
    )
    images = batch.vision.gather(list(range(len(problems))))  # type: ignore[union-attr]
    pos, _ = row_positions(model, batch.input_ids, batch.attention_mask, images)  # M-RoPE, as the model's own
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos, **images
    ).logits
    return torch.nn.functional.cross_entropy(
        logits[:, -3:-1].flatten(0, 1), batch.input_ids[:, -2:].flatten()
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model, processor = build_policy(args.seed)
    task = VisionTask(VisionConfig(), processor, seed=args.seed)
    evals = task.eval_problems()
    tok = processor.tokenizer  # type: ignore[attr-defined]
    params = SamplingParams(group_size=1, max_new_tokens=4, temperature=0.0, pad_token_id=tok.pad_token_id,
                            eos_token_ids=(tok.eos_token_id,))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, acc = time.time(), 0.0
    for step in range(1, args.max_steps + 1):
        model.train()
        problems = [task.train_problem((step - 1) * args.batch + i) for i in range(args.batch)]
        loss = sft_loss(model, processor, problems)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            model.eval()
            acc = eval_accuracy(ReferenceSampler(model), task, evals, processor, params)
            print(
                f"step {step}: loss {loss.item():.3f}, greedy held-out accuracy {acc:.3f} ({time.time() - start:.0f} s)"
            )
            if acc >= args.until:
                break
    else:
        raise SystemExit(
            f"--until {args.until}: not reached in {args.max_steps} steps (last accuracy {acc:.3f})"
        )
    model.eval().save_pretrained(args.out)
    print(f"wrote {args.out} (greedy held-out accuracy {acc:.3f} at step {step})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
