"""The loop behind `grpo-parts train`, built by hand from the four parts.

    python examples/train_from_parts.py [--steps 20]

Swap any line in "the four parts" for its reference (ReferenceSampler, RepeatedPrefixAttention,
KeepAll) and the run computes the same GRPO update -- only slower.
"""

import argparse

import torch

from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.task.arithmetic import ArithmeticConfig, ArithmeticTask
from grpo_parts.train.config import TrainConfig
from grpo_parts.train.lifecycle.setup import builtin_model_path, eos_ids, load_model
from grpo_parts.train.step.loop import GRPOTrainer
from grpo_parts.train.step.parts import Parts

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()
torch.set_num_threads(1)  # fastest for a tiny model on a CPU

task_config = ArithmeticConfig()
config = TrainConfig(steps=args.steps, prompts_per_step=16, group_size=8, lr=1e-4, seed=0, task=task_config)
policy, tokenizer = load_model(builtin_model_path(), torch.float32, torch.device("cpu"))
task = ArithmeticTask(task_config, seed=config.seed)

# the four parts
draft = NGramDraft(max_ngram=4)  # copies from the prompt, sibling completions and earlier rollouts
sampler = SpeculativeSampler(policy, draft, SpeculativeConfig(train_draft=False))
attention = SharedPrefixAttention()  # each prompt encoded once per group
completion_filter = TopKAbsAdvantage(pruning_rate=0.5)  # CPPO: train on the half with the largest |A|

parts = Parts(
    sampler, attention, completion_filter, draft, names={"sampler": "speculative", "draft": "ngram"}
)
trainer = GRPOTrainer(config, policy, tokenizer, task, parts, eos_ids(policy, tokenizer))

accuracy, _ = trainer.evaluate()
print(f"step 0: held-out accuracy {accuracy:.2f}")
for _ in range(config.steps):
    m = trainer.step()  # rollout -> reward -> advantages -> filter -> old logps -> update
    line = f"step {m['step']}: reward {m['reward']:.2f} kept {m['kept']} rollout {m['time_rollout']:.2f}s"
    line += f" training {m['time_training']:.2f}s accepted/verify {m['accepted_per_verify']:.2f}"
    if m["step"] % 10 == 0:
        line += f" held-out accuracy {trainer.evaluate()[0]:.2f}"
    print(line)
