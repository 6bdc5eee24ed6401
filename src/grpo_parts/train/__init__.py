"""The embedded GRPO trainer: ``grpo-parts train`` composes the four parts on a built-in task.

Import lazily: ``from grpo_parts.train.loop import GRPOTrainer``, ``from grpo_parts.train.run import train``.
"""
