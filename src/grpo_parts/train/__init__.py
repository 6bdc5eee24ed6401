"""The embedded GRPO trainer: ``grpo-parts train`` composes the four parts on a built-in task.

Split by concern: configuration and the command line here (:mod:`.config`, :mod:`.flags`,
:mod:`.cli`), one training step in :mod:`.step`, a run's lifecycle in :mod:`.lifecycle`, what a run
writes for people in :mod:`.reporting`, runs side by side in :mod:`.experiments`.

Import lazily: ``from grpo_parts.train.step.loop import GRPOTrainer``,
``from grpo_parts.train.lifecycle.run import train`` (the earlier ``grpo_parts.train.loop``,
``.run``, ``.parts`` and ``.setup`` still re-export what examples import from them).
"""
