"""The embedded GRPO trainer: ``grpo-parts train`` composes the five parts (sampler, draft,
attention backend, completion filter, prompt skipper: one Protocol each) on a built-in task.

Import lazily: ``from grpo_parts.train.step.loop import GRPOTrainer``,
``from grpo_parts.train.lifecycle.run import train``.
"""
