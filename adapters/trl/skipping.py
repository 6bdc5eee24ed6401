"""The prompt-skipping seam of :class:`~.trainer.GRPOPartsTrainer`: TRL's generation batch's prompts, then
a seeded stream over ``train_dataset``, go through the shared :class:`~grpo_parts.skip.stage.SkipStage`,
keeping exactly as many as TRL expects. Each row's advantage is multiplied by its prompt's weight (TRL's
losses are positively homogeneous in it; the normaliser is the drawn batch's, fixed before the draw); what
cannot stay unbiased is refused at construction. docs/adapters/trl.md, docs/filter.md."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grpo_parts.core.unbiased import Fact, WeightedLossFacts, refusal_reasons
from grpo_parts.doors.skipping import build_skipper
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.skip.protocol import PromptId, PromptSkipper, prompt_id
from grpo_parts.skip.stage import SkipStage

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
        batch_wide = "scale_rewards='batch' / multi_objective_aggregation='normalize_then_sum'"
        stats = ((batch_wide, "use scale_rewards='group' or 'none'"),)
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
    """The skipper ``spec`` names (``None``, ``"none"``, ``"history"`` or an instance; None where it never
    skips), with the run's :class:`~grpo_parts.skip.stage.SkipStage` (``_gp_stage``). Where this trainer's
    config cannot keep it unbiased: refused (``parts_options.strict``), else logged, all prompts kept."""
    trainer._gp_stage, trainer._gp_skip = None, None
    try:
        skipper = build_skipper(
            "none" if spec is None else spec,
            kwargs,
            door="TRL",
            setting="prompt_skip",
            reasons=lambda: skip_config_reasons(trainer, trainer.parts_config),
        )
    except NotSupportedError as e:
        if trainer.parts_options.strict:
            raise
        trainer.parts_refused["prompt_skip"] = e.reasons
        logger.warning(
            "grpo_parts: %s not applied, every prompt is rolled out: %s", e.impl, "; ".join(e.reasons)
        )
        return None
    if skipper is not None:
        stream = BatchThenStream(trainer._gp_prompt_stream)
        trainer._gp_stage = SkipStage(
            skipper, int(trainer.num_generations or 1), stream, row_prompt_key, "TRL"
        )
    return skipper


def row_prompt_key(row: dict[str, Any]) -> PromptId:
    """The id of a TRL row's prompt: its text, or its messages as canonical JSON."""
    return prompt_id(row.get("prompt"))


class BatchThenStream(Iterator[dict[str, Any]]):
    """TRL's prompts of the current batch (:attr:`batch`), then a seeded stream over
    ``train_dataset`` (opened on first use), with ``peek()``: a prompt the draw reads but cannot fit
    stays at the stream's head for the next batch."""

    def __init__(self, open_stream: Callable[[], Iterator[dict[str, Any]]]) -> None:
        self.open_stream = open_stream
        self.stream: Iterator[dict[str, Any]] | None = None
        self.batch: list[dict[str, Any]] = []
        self.ahead: list[dict[str, Any]] = []

    def peek(self) -> dict[str, Any]:
        if self.batch:
            return self.batch[0]
        if not self.ahead:
            self.stream = self.stream or self.open_stream()
            self.ahead.append(next(self.stream))
        return self.ahead[0]

    def __next__(self) -> dict[str, Any]:
        row = self.peek()
        (self.batch if self.batch else self.ahead).pop(0)
        return row


class SkipSeam(StateSeam):
    """``GRPOTrainer`` with the prompt-skipping stage; set up by :class:`~.trainer.GRPOPartsTrainer`.
    ``_gp_skip``: this batch's row weights ``[N]`` (None: no skipping in this batch)."""

    gp_skipper: PromptSkipper | None
    parts_options: TRLPartsOptions
    parts_config: PartsConfig
    parts_refused: dict[str, list[str]]
    _gp_stage: SkipStage[dict[str, Any]] | None
    _gp_skip: torch.Tensor | None
    _gp_skip_ids: list[PromptId]

    def _gp_prompt_stream(self) -> Iterator[dict[str, Any]]:
        """``train_dataset`` in a seeded order independent of TRL's dataloader (``refill_seed``,
        default ``args.seed + 1``), for ever."""
        seed = self.parts_options.refill_seed
        gen = torch.Generator().manual_seed(int(self.args.seed) + 1 if seed is None else seed)
        ds = self.train_dataset
        while True:
            for i in torch.randperm(len(ds), generator=gen).tolist():  # type: ignore[arg-type]
                yield ds[i]  # type: ignore[index]

    def _gp_skip_prompts(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``inputs`` with its prompts drawn through the stage (module docstring); sets ``_gp_skip``."""
        stage = self._gp_stage
        assert stage is not None
        g = stage.group_size
        if len(inputs) % g or any(
            row_prompt_key(r) != row_prompt_key(inputs[i - i % g]) for i, r in enumerate(inputs)
        ):
            raise GRPOPartsError(
                f"prompt_skip: expected TRL's generation batch as runs of num_generations={g} rows per prompt, "
                f"got {len(inputs)} rows that are not"
            )
        stage.draw.stream.batch = list(inputs[::g])  # type: ignore[attr-defined]
        rows = [copy.deepcopy(row) for row in stage.take_round(len(inputs) // g) for _ in range(g)]
        self._gp_skip_ids = [row_prompt_key(r) for r in rows]
        self._gp_skip = stage.weights_for(self._gp_skip_ids)
        return rows

    def _gp_skip_observe(self, rewards: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
        """The skipper learns from the rolled-out rows' ``rewards: [N]`` (weighted sum over the
        reward functions) and completion ``lengths: [N]``; returns the batch's skip metrics."""
        stage = self._gp_stage
        assert stage is not None
        groups = torch.arange(rewards.numel()) // stage.group_size
        r = torch.nan_to_num(rewards.detach().cpu().double(), nan=0.0)
        stage.observe(self._gp_skip_ids, r, groups, lengths.detach().cpu())
        return stage.metrics(float(lengths.float().mean()) if lengths.numel() else 0.0)
