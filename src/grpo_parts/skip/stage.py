"""Prompt skipping at a framework's prompt seam: one step's prompts drawn past a skipper, their
row weights, the history, the counters -- what every framework door shares.

A door (TRL's generation batch, OpenRLHF's samples generator, verl's trainer) hands them to a
:class:`SkipStage`, which draws a round through :class:`~.draw.PromptDraw` as ``grpo-parts train`` does;
only kept prompts are rolled out, their rows weighing ``1 / p`` times ``rolled-out / drawn prompts``
(:meth:`SkipStage.prompt_weights`: the drawn batch's normaliser in expectation). docs/filter.md, "Behind
TRL" / "Behind OpenRLHF" / "Behind verl". Only ``step_size: fill`` is served here: these frameworks train
whole steps of a fixed prompt count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from ..errors import GRPOPartsError, NotSupportedError
from .draw import PromptDraw
from .protocol import PromptId, PromptSkipper, skips

P = TypeVar("P")
log = logging.getLogger(__name__)


def off_note(setting: str, reasons: list[str]) -> str:
    """The one line a framework door logs when prompt skipping was not asked for: it is opt-in behind
    every door (docs/results.md, "The finite-data default"), what turns it on, and whether this run's
    loss (the user's) could stay unbiased under it. ``setting``: the door's switch; ``reasons``: what
    this run's config would refuse."""
    line = f"grpo_parts: prompt skipping is opt-in ({setting}=history turns it on)"
    if reasons:
        return f"{line}; this run would refuse it: {reasons[0]}"
    return f"{line}; this run's loss would stay unbiased under it"


def fill_reasons(skipper: PromptSkipper, door: str) -> list[str]:
    """Why ``door`` cannot run ``skipper``: only ``step_size: fill`` is served (module docstring)."""
    if skipper.step_size == "fill":
        return []
    return [
        f"step_size={skipper.step_size!r}: {door} trains whole steps of a fixed prompt count; expected "
        "'fill' (skipped prompts are made up for by drawing more)"
    ]


def checked_skipper(
    skipper: PromptSkipper, *, door: str, setting: str, reasons: Callable[[], list[str]]
) -> PromptSkipper | None:
    """``skipper`` (built by :func:`grpo_parts.build.build_prompt_skipper`), or None when it keeps
    every prompt (``none``: :func:`off_note` logged); refused in one line under ``setting`` (the
    door's switch) when it does not fill whole steps (:func:`fill_reasons`) or ``reasons()`` -- the
    door's check that its loss stays unbiased under ``1 / p`` weights -- names any setting."""
    if not skips(skipper):
        if getattr(skipper, "name", None) == "none":
            log.info(off_note(setting, reasons()))
        return None
    refused = fill_reasons(skipper, door) + reasons()
    if refused:
        raise NotSupportedError(f"{setting}={getattr(skipper, 'name', type(skipper).__name__)!r}", refused)
    return skipper


class SkipStage(Generic[P]):
    """One run's skipping: :meth:`take_round` a step's prompts from ``stream``, then
    :meth:`weights_for` / :meth:`observe` / :meth:`metrics` for that step. ``key(prompt) -> PromptId``
    (:func:`~.protocol.prompt_id` of its text or messages); ``door`` names the framework in refusals."""

    def __init__(
        self,
        skipper: PromptSkipper,
        group_size: int,
        stream: Iterator[P],
        key: Callable[[P], PromptId],
        door: str,
    ) -> None:
        if fill_reasons(skipper, door):
            raise GRPOPartsError(f"prompt_skip_kwargs.{fill_reasons(skipper, door)[0]}")
        self.skipper, self.group_size, self.door = skipper, group_size, door
        self.draw: PromptDraw[P] = PromptDraw(skipper, stream, key=key)

    def take_round(self, num_prompts: int) -> list[P]:
        """The next step's ``num_prompts`` kept prompts (fewer only when the stream runs out)."""
        self.draw.rounds.clear()  # one round per step
        return self.draw.take(num_prompts)

    def prompt_weights(self) -> dict[PromptId, float]:
        """Each rolled-out prompt's row weight this step: ``1 / p`` times ``rolled-out / drawn``."""
        if not self.draw.rounds:
            return {}
        (r,) = self.draw.rounds
        scale = 1.0 / self.draw.normaliser_scale()
        return {pid: float(w) * scale for pid, w in zip(r.kept_ids, r.weights.tolist())}

    def weights_for(self, ids: Sequence[PromptId]) -> torch.Tensor:
        """``[rows]`` float64: each row's weight, by the id of the prompt it was generated for."""
        weights = self.prompt_weights()
        missing = [i for i in ids if i not in weights]
        if missing:
            raise GRPOPartsError(
                f"prompt skipping: a row's prompt was not among this step's rolled-out prompts "
                f"(id {missing[0]}); expected {self.door} to keep the prompts as they were drawn"
            )
        return torch.tensor([weights[i] for i in ids], dtype=torch.float64)

    def observe(
        self,
        ids: Sequence[PromptId],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None,
    ) -> None:
        """Tell the skipper every rolled-out group of the step (``ids``: each row's prompt id;
        ``rewards``, ``group_index``, ``lengths``: ``[rows]``)."""
        by_group: dict[int, PromptId] = {}
        for pid, g in zip(ids, group_index.tolist()):
            by_group.setdefault(int(g), pid)
        order = [by_group[g] for g in range(len(by_group))]
        self.skipper.observe(order, rewards.double(), group_index, lengths)

    def metrics(self, fallback_length: float) -> dict[str, float]:
        return self.draw.metrics(self.group_size, fallback_length)

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_skip": self.skipper.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipper.load_state_dict(state["prompt_skip"])
