"""The prompt-skipping seam of :class:`~.trainer.GRPOPartsTrainer` (``prompt_skip="history"``): a
TRL generation batch's prompts are drawn through a :class:`~grpo_parts.skip.protocol.PromptSkipper`
before TRL generates, so prompts whose recent groups all had equal rewards are rolled out less often.

**A batch.** TRL hands ``_generate_and_score_completions`` its generation batch: ``n`` prompts, each
repeated ``num_generations`` times in a row. Their ids (:func:`~grpo_parts.skip.protocol.prompt_key`
of the prompt) go first into a :class:`~grpo_parts.skip.draw.PromptDraw`, followed by a seeded
stream over ``train_dataset`` (``args.seed + 1``, independent of TRL's dataloader): the draw takes
prompts while their inclusion probabilities fit ``n`` (so TRL's ``n`` prompts always, plus as many of
the stream's as the skipped ones leave room for), keeps exactly ``n`` of them (systematic sampling),
and TRL generates and scores those. The batch keeps its size, so TRL's chunking, gathers and
micro-batches are untouched.

**Weights.** Each rolled-out row's advantage is multiplied by its prompt's ``1 / p`` times
``rolled out / drawn`` prompts (TRL's policy losses are positively homogeneous in the advantage, so
this scales the row's whole loss term). With the losses TRL normalises by each micro-batch's row
count (``grpo``, ``sapo``, ``dr_grpo``, ``luspo``) that makes every optimizer step's expectation the
drawn batch's loss: the normaliser is the drawn prompts' ``drawn x G`` rows, fixed before the draw
(the proof over every outcome: tests/skip/test_prompt_skip.py). A weighted completion filter
(``dppo``) multiplies its own ``1 / p`` in. What cannot stay unbiased is refused at construction
(:func:`skip_config_reasons`).

**Learning.** After TRL's rewards the skipper observes every rolled-out group (its weighted reward
sum, before advantages), one adaptation per generation batch. TRL's metrics get
``parts/prompt_skip/{prompts_drawn, prompts_skipped, skip_rollout_tokens_saved, skip_max_weight, ...}``.

**Checkpoints.** The skipper's history (and a ``dppo`` filter's generator) is saved into every TRL
checkpoint folder and read back by ``train(resume_from_checkpoint=...)`` (:mod:`.checkpoint`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from grpo_parts.build import build_prompt_skipper
from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.skip.draw import PromptDraw
from grpo_parts.skip.protocol import PromptId, PromptSkipper, prompt_id, skips
from grpo_parts.skip.stage import off_note

from .checkpoint import StateSeam
from .options import ROW_NORMALISED_LOSSES, PartsConfig, TRLPartsOptions, draw_dependent, unscaled_terms

logger = logging.getLogger(__name__)


def skip_config_reasons(trainer: Any, parts: PartsConfig) -> list[str]:
    """Why skipping prompts with ``1 / p`` weights would not give this trainer the drawn batch's
    expected gradient (empty: it does). The estimate is exact when each row's loss term depends on
    its own group only, scales with its advantage, and the normaliser is fixed before the draw."""
    get = lambda name, default=None: getattr(trainer, name, default)  # noqa: E731
    loss = get("loss_type")
    tokens: tuple[Fact, ...] = ()
    if loss not in ROW_NORMALISED_LOSSES:  # TRL's row-normalised losses count every row, empty ones too
        tokens = ((f"loss_type={loss!r}", f"use one of {list(ROW_NORMALISED_LOSSES)}"),)
    stats: tuple[Fact, ...] = ()
    if get("scale_rewards") == "batch" or get("multi_objective_aggregation") == "normalize_then_sum":
        stats = (
            (
                "scale_rewards='batch' / multi_objective_aggregation='normalize_then_sum'",
                "use scale_rewards='group' or 'none'",
            ),
        )
    facts = WeightedLossFacts(
        source="prompt skipping",
        normaliser="drawn",
        refill=(f"parts.refill_rounds={parts.refill_rounds}", "set refill_rounds=0")
        if parts.refill_rounds
        else None,
        unscaled=unscaled_terms(trainer),
        batch_statistics=stats,
        normaliser_from_draw=draw_dependent(trainer),
        token_normalised=tokens,
    )
    reasons = refusal_reasons(facts)
    acc = get("accelerator")
    if acc is not None and getattr(acc, "num_processes", 1) > 1:
        reasons.append(
            "several processes: each would top its batch up from the same prompt stream; use one process"
        )
    ds = get("train_dataset")
    if ds is not None and not hasattr(ds, "__getitem__"):
        reasons.append(
            "an IterableDataset: the prompts that top a batch up are drawn from a map-style train_dataset"
        )
    return reasons


def accept_skipper(trainer: SkipSeam, spec: Any, kwargs: dict[str, Any] | None) -> PromptSkipper | None:
    """The skipper ``spec`` names (``None``, ``"none"``, ``"history"`` or an instance), or None where
    it never skips; where this trainer's config cannot keep it unbiased: refused
    (``parts_options.strict``), else logged at WARNING and every prompt rolled out."""
    trainer._gp_skip, trainer._gp_skip_ahead, trainer._gp_skip_stream = None, [], None
    if spec is None or spec == "none":
        logger.info(off_note("prompt_skip", skip_config_reasons(trainer, trainer.parts_config)))
        return None
    skipper = build_prompt_skipper(spec, kwargs=kwargs)
    if not skips(skipper):
        return None
    reasons = skip_config_reasons(trainer, trainer.parts_config)
    if skipper.step_size != "fill":
        reasons.append(
            f"step_size={skipper.step_size!r}: TRL's generation batch has a fixed size (use 'fill': "
            "skipped prompts are made up for by drawing more)"
        )
    if not reasons:
        return skipper
    if trainer.parts_options.strict:
        raise NotSupportedError(f"prompt_skip {spec!r} on this GRPOTrainer", reasons)
    trainer.parts_refused["prompt_skip"] = reasons
    logger.warning(
        "grpo_parts: prompt_skip %r not applied, every prompt is rolled out: %s", spec, "; ".join(reasons)
    )
    return None


def row_prompt_key(row: dict[str, Any]) -> PromptId:
    """The id of a TRL row's prompt: its text, or its messages as canonical JSON."""
    return prompt_id(row.get("prompt"))


class _BatchThenStream(Iterator[dict[str, Any]]):
    """TRL's prompts, then the seeded stream's, with ``peek()``: a prompt the draw reads but cannot fit
    stays at the stream's head for the next batch."""

    def __init__(
        self, batch: list[dict[str, Any]], stream: Iterator[dict[str, Any]], ahead: list[dict[str, Any]]
    ):
        self.batch, self.stream, self.ahead = list(batch), stream, ahead

    def peek(self) -> dict[str, Any]:
        if self.batch:
            return self.batch[0]
        if not self.ahead:
            self.ahead.append(next(self.stream))
        return self.ahead[0]

    def __next__(self) -> dict[str, Any]:
        row = self.peek()
        (self.batch if self.batch else self.ahead).pop(0)
        return row


@dataclass(frozen=True)
class SkipBatch:
    """One generation batch's draw: ``row_weights: [N]`` float64, each rolled-out row's prompt
    ``1 / p`` times ``rolled out / drawn`` (rows in TRL's order, ``G`` per prompt)."""

    draw: PromptDraw[dict[str, Any]]
    row_weights: torch.Tensor


class SkipSeam(StateSeam):
    """``GRPOTrainer`` with the prompt-skipping stage; set up by :class:`~.trainer.GRPOPartsTrainer`."""

    gp_skipper: PromptSkipper | None
    parts_options: TRLPartsOptions
    parts_config: PartsConfig
    parts_refused: dict[str, list[str]]
    _gp_skip: SkipBatch | None
    _gp_skip_ahead: list[dict[str, Any]]
    _gp_skip_stream: Iterator[dict[str, Any]] | None

    def _gp_prompt_stream(self, seed: int) -> Iterator[dict[str, Any]]:
        gen = torch.Generator().manual_seed(seed)
        ds = self.train_dataset
        while True:
            for i in torch.randperm(len(ds), generator=gen).tolist():  # type: ignore[arg-type]
                yield ds[i]  # type: ignore[index]

    def _gp_skip_prompts(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``inputs`` with its prompts drawn through the skipper (module docstring); sets ``_gp_skip``."""
        assert self.gp_skipper is not None
        g = int(self.num_generations or 1)
        prompts = inputs[::g]
        if len(inputs) % g or any(
            row_prompt_key(r) != row_prompt_key(inputs[i - i % g]) for i, r in enumerate(inputs)
        ):
            raise GRPOPartsError(
                f"prompt_skip: expected TRL's generation batch as runs of num_generations={g} rows per prompt, "
                f"got {len(inputs)} rows that are not"
            )
        if self._gp_skip_stream is None:
            seed = self.parts_options.refill_seed
            self._gp_skip_stream = self._gp_prompt_stream(int(self.args.seed) + 1 if seed is None else seed)
        stream = _BatchThenStream(prompts, self._gp_skip_stream, self._gp_skip_ahead)
        draw = PromptDraw(self.gp_skipper, stream, row_prompt_key)
        kept = draw.take(len(prompts))
        weights = draw.prompt_weights() / draw.normaliser_scale()
        self._gp_skip = SkipBatch(draw, weights.repeat_interleave(g))
        return [copy.deepcopy(row) for row in kept for _ in range(g)]

    def _gp_skip_observe(self, rewards: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
        """The skipper learns from the rolled-out rows' ``rewards: [N]`` (weighted sum over the
        reward functions) and completion ``lengths: [N]``; returns the batch's skip metrics."""
        assert self._gp_skip is not None
        g = int(self.num_generations or 1)
        groups = torch.arange(rewards.numel()) // g
        r = torch.nan_to_num(rewards.detach().cpu().double(), nan=0.0)
        self._gp_skip.draw.observe([r], [groups], [lengths.detach().cpu()])
        fallback = float(lengths.float().mean()) if lengths.numel() else 0.0
        return self._gp_skip.draw.metrics(g, fallback)
