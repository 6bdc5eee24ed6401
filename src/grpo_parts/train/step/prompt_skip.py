"""The trainer's side of prompt skipping (``parts.prompt_skip``): prompts drawn through a
:class:`~grpo_parts.skip.draw.PromptDraw`, and the minibatches re-weighted for them: each kept row times
its prompt's ``1 / p`` over the drawn prompts' sequence count, fixed before the draw, which keeps the
estimate unbiased (docs/training.md, "The step"; docs/filter.md, "Skipping prompts before rollout")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from ...errors import GRPOPartsError
from ...filter.refill import FilledBatch
from ...skip.draw import PromptDraw
from ...skip.protocol import PromptId, PromptSkipper, prompt_key, skips
from ...task.data import Problem
from ...types import Rollout
from .minibatches import Minibatch

__all__ = ["observe_step", "problem_key", "skip_minibatches", "skipping_stream"]


def problem_key(problem: Problem) -> PromptId:
    """A problem's stable id: :func:`~grpo_parts.skip.protocol.prompt_key` of its prompt text."""
    return prompt_key(problem.prompt)


def skipping_stream(
    skipper: PromptSkipper, stream: Iterator[Problem]
) -> tuple[Iterator[Problem], PromptDraw[Problem] | None]:
    """``stream`` drawn through ``skipper`` (and the draw, to read after the fill), or ``stream``
    itself when the skipper never skips (``none``)."""
    if not skips(skipper):
        return stream, None
    draw = PromptDraw(skipper, stream, problem_key)
    return draw, draw


def skip_minibatches(
    batches: list[Minibatch], filled: FilledBatch[Any], draw: PromptDraw[Any], count_empty: bool
) -> list[Minibatch]:
    """``batches`` with each row's prompt weight multiplied in and ``num_seqs`` scaled to the drawn
    prompts (module docstring). ``count_empty``: ``LossConfig.seq_count == "all"``."""
    ro = filled.rollout
    assert ro is not None and filled.full_group is not None
    if not count_empty and bool((ro.completion_mask.sum(-1) == 0).any()):
        # the config accepted seq_count='nonempty' because no row can be empty (prompt_skip_reasons)
        raise GRPOPartsError(
            "prompt skipping: a completion without a token under loss.seq_count='nonempty' makes the drawn "
            "batch's sequence count unknown (biased); set loss.seq_count='all'"
        )
    prompt_w = draw.prompt_weights()[filled.full_group.cpu()]
    scale = draw.normaliser_scale()
    out = []
    for mb in batches:
        rows = mb.rows.cpu()
        w = prompt_w[rows] if mb.weights is None else prompt_w[rows] * mb.weights.cpu().double()
        seqs = mb.num_seqs
        if seqs is None:  # a plain filter: the minibatch's own rows, as grpo_loss would count them
            tokens = ro.completion_mask[mb.rows].long().sum(-1)
            seqs = float(tokens.numel() if count_empty else (tokens > 0).sum())
        out.append(replace(mb, weights=w.to(mb.rows.device), num_seqs=seqs * scale))
    return out


def observe_step(draw: PromptDraw[Any], rollouts: list[Rollout], rewards: list[torch.Tensor]) -> None:
    """The skipper learns from every rollout of the step (``rollouts`` and their raw ``rewards``, one
    per round that rolled something out, in order)."""
    draw.observe(rewards, [r.group_index for r in rollouts], [r.completion_lengths() for r in rollouts])
