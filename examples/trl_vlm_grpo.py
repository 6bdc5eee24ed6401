"""VLM GRPO with TRL 1.16's GRPOTrainer and grpo_parts' parts, on CPU in under a minute.

A tiny Qwen2-VL (random init, from a config) is asked the colour of a square image and rewarded
for answering with its letter (``r``, ``g`` or ``b``); a random model learns little in a few steps:
the example shows the lines a TRL user changes and what ran (the counters). The processor is built offline
(``grpo_parts.tiny_vision.tiny_processor``); the dataset is in TRL's image format: a
conversational ``prompt`` with an image part and an ``image`` column.

    python examples/trl_vlm_grpo.py              # reference sampler + shared-prefix attention + CPPO
    python examples/trl_vlm_grpo.py --plain      # stock GRPOTrainer, for comparison

The lines a TRL user adds are in ``build_trainer``: ``GRPOPartsTrainer`` instead of ``GRPOTrainer``
plus the part switches; the processor, dataset and reward are TRL's as they were.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220)}


def build_dataset(n: int, size: int, seed: int) -> Any:
    """``n`` square images of one colour each (plus noise), the question, and the answer letter."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    letters = [list(COLOURS)[int(i)] for i in rng.integers(0, 3, n)]
    images = [
        Image.fromarray(
            np.clip(np.array(COLOURS[c]) + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
        )
        for c in letters
    ]
    question = [{"type": "image"}, {"type": "text", "text": "what r g b"}]
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": question}]] * n, "image": images, "answer": letters}
    )


def colour_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The fraction of the completion's words that are the image's colour letter."""
    out = []
    for c, a in zip(completions, answer):
        words = c[0]["content"].split()
        out.append(sum(w == a for w in words) / max(1, len(words)))
    return out


def build_trainer(args: argparse.Namespace) -> Any:
    import torch
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from grpo_parts.tiny_vision import tiny_processor, tiny_vlm

    set_seed(args.seed)
    model = tiny_vlm("qwen2_vl", hidden_size=64, seed=args.seed, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, report_to="none", save_strategy="no",
        per_device_train_batch_size=4 * args.group, num_generations=args.group, max_steps=args.steps,
        max_completion_length=8, learning_rate=args.lr, logging_steps=1, disable_tqdm=True, seed=args.seed,
    )  # fmt: skip
    common = dict(
        model=model, reward_funcs=colour_reward, args=config, processing_class=tiny_processor(model),
        train_dataset=build_dataset(4 * args.steps, args.image_size, args.seed),
    )  # fmt: skip
    if args.plain:
        return GRPOTrainer(**common)
    from grpo_parts_adapters.trl import GRPOPartsTrainer

    return GRPOPartsTrainer(
        **common, sampler="reference", attention="shared_prefix",
        filter="cppo", filter_kwargs={"pruning_rate": 0.25},
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", action="store_true", help="stock GRPOTrainer, no parts")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--image-size", type=int, default=16, help="image side in pixels (16: 16 image tokens)")
    p.add_argument("--lr", type=float, default=2e-2, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and sampling")
    p.add_argument("--output-dir", default="/tmp/grpo_parts_trl_vlm", help="TRL's output_dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    trainer = build_trainer(args)
    start = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    counters = {k: sum(float(h.get(k, 0)) for h in logs) for k in logs[0] if k.startswith("parts/")}
    print(
        f"{len(logs)} steps in {time.perf_counter() - start:.1f} s; reward {logs[0]['reward']:.3f} -> {logs[-1]['reward']:.3f}"
    )
    if counters:
        print("what ran:", {k: v for k, v in counters.items() if v})
    return {"rewards": [float(h["reward"]) for h in logs], "counters": counters}


if __name__ == "__main__":
    main()
