"""The embedded GRPO trainer: ``grpo-parts train`` composes the five parts (sampler, draft,
attention backend, completion filter, prompt skipper: one Protocol each) on a built-in task.

Split by concern: configuration and the command line here (:mod:`.config`, :mod:`.flags`,
:mod:`.cli`), one training step in :mod:`.step`, a run's lifecycle in :mod:`.lifecycle`, what a run
writes for people in :mod:`.reporting`, runs side by side in :mod:`.experiments`.

Import lazily: ``from grpo_parts.train.step.loop import GRPOTrainer``,
``from grpo_parts.train.lifecycle.run import train``.
"""
