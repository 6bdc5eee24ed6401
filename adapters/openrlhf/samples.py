"""The trainer's samples generator: OpenRLHF's ``SamplesGenerator`` plus
:meth:`~GRPOPartsSamplesGenerator.generate_prompts` (refill) from the same prompt stream through the same
vLLM dispatch. A refill that drains the stream makes the next call report the episode exhausted instead
of restarting the dataloader. With ``skip_stage`` (:mod:`.skipping`) each training step's prompts pass
the skipper before vLLM. docs/adapters/openrlhf.md, "CompletionFilter"."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

from grpo_parts.counters import PartCounters

from .agent import SAMPLER_MARK
from .skipping import SkipStage

logger = logging.getLogger(__name__)


class GRPOPartsSamplesGenerator(SamplesGenerator):
    """``SamplesGenerator`` with :meth:`generate_prompts` (refill) and rollout counting in ``counters``
    (the trainer's, flushed per step); ``speculative``: the vLLM engines run a grpo_parts
    ``speculative_config``."""

    def __init__(
        self,
        *args: Any,
        counters: PartCounters | None = None,
        speculative: bool = False,
        skip_stage: SkipStage | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.skip_stage = skip_stage
        self.counters = counters if counters is not None else PartCounters({"sampler": "rollouts"}, logger)
        self.speculative = speculative
        self.refill_drained_stream = False
        if speculative:
            self.counters.track("sampler")

    def count(self, samples: list[Any]) -> None:
        for s in samples:
            marked = s.info.pop(SAMPLER_MARK, None) is not None
            if marked or self.speculative:
                self.counters.ran("sampler", n=len(s.sequences))

    def generate_samples(self, **generate_kwargs: Any) -> Any:
        if self.refill_drained_stream and getattr(self, "_dataloader_iter", None) is None:
            if not getattr(self, "_sample_buffer", None):
                self.refill_drained_stream = False
                return [], None, 0, True  # the refill used the episode's last prompts
        samples, pass_rate, consumed, exhausted = super().generate_samples(**generate_kwargs)
        if exhausted:  # the episode ends here (e.g. buffered samples drained after the refill)
            self.refill_drained_stream = False
        self.count(samples)
        return samples, pass_rate, consumed, exhausted

    def _generate_vllm(
        self, dataloader_iter: Any, num_prompts: int, dynamic_filtering: bool, **generate_kwargs: Any
    ) -> tuple[list[Any], int, bool]:
        """OpenRLHF's, with a training step's prompts passed through :attr:`skip_stage` first: the
        kept prompts are generated, the drawn ones reported as consumed."""
        training = dataloader_iter is getattr(self, "_dataloader_iter", None)
        if self.skip_stage is None or not training:
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        prompts, labels, images, exhausted = self.skip_stage.take(dataloader_iter, num_prompts)
        if not prompts:
            return [], self.skip_stage.draw.num_drawn, True
        batch = iter([(None, prompts, labels, images)])
        experiences = self._generate_kept(batch, len(prompts), **generate_kwargs)
        return experiences, self.skip_stage.draw.num_drawn, exhausted

    def _generate_kept(self, batch: Any, num_prompts: int, **generate_kwargs: Any) -> list[Any]:
        """The kept prompts' samples, through OpenRLHF's own vLLM dispatch."""
        return list(super()._generate_vllm(batch, num_prompts, False, **generate_kwargs)[0])

    def generate_prompts(
        self, num_prompts: int, before_wake: Callable[[], None] | None = None, **generate_kwargs: Any
    ) -> list[Any]:
        """Samples for up to ``num_prompts`` more prompts of the current episode's stream (fewer,
        or none, when it runs out), with rewards, as ``generate_samples`` returns them."""
        it = getattr(self, "_dataloader_iter", None)
        if it is None or num_prompts <= 0:
            return []
        sleep = bool(self.args.vllm.enable_sleep)
        if sleep:
            if before_wake is not None:
                before_wake()
            batch_vllm_engine_call(self.vllm_engines, "wake_up")
        try:
            samples, _, exhausted = self._generate_vllm(
                dataloader_iter=it,
                num_prompts=num_prompts,
                dynamic_filtering=self.args.algo.dynamic_filtering_enable,
                **generate_kwargs,
            )
        finally:
            if sleep:
                batch_vllm_engine_call(self.vllm_engines, "sleep")
        if exhausted:
            self._dataloader_iter = None
            self.refill_drained_stream = True
            logger.info("Prompt dataloader is exhausted (by a grpo_parts refill).")
        samples = list(samples)
        self.count(samples)
        return samples
