"""Prompt skipping in OpenRLHF: the prompts of OpenRLHF's dataloader pass the shared
:class:`grpo_parts.skip.stage.SkipStage` one by one before vLLM sees them; only the kept ones are generated.
The experience maker weighs and observes the rows; the history travels in OpenRLHF's checkpoint
``client_states`` (:mod:`.ray_actors`). No OpenRLHF import. docs/adapters/openrlhf.md, "Prompt skipping"."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from grpo_parts.skip.protocol import PromptSkipper, prompt_id
from grpo_parts.skip.stage import SkipStage as BaseStage

#: one prompt of OpenRLHF's dataloader: (prompt, label, image)
Item = tuple[Any, Any, Any]


class FlatPrompts(Iterator[Item]):
    """The prompts of OpenRLHF's current dataloader iterator, one at a time (its batches yield
    ``(index, prompts, labels, images)``); ``source`` is swapped at each episode."""

    def __init__(self) -> None:
        self.source: Iterator[Any] | None = None
        self.buffer: deque[Item] = deque()
        self.drained = False

    def use(self, source: Iterator[Any]) -> None:
        if source is not self.source:
            self.source, self.drained = source, False

    def __next__(self) -> Item:
        while not self.buffer:
            if self.source is None or self.drained:
                raise StopIteration
            try:
                _, prompts, labels, images = next(self.source)
            except StopIteration:
                self.drained = True
                raise
            self.buffer.extend(zip(prompts, labels, images))
        return self.buffer.popleft()


class SkipStage(BaseStage[Item]):
    """The skipping stage of one OpenRLHF run over the dataloader's prompts: :meth:`take` a step's prompts,
    then :meth:`row_weights` / :meth:`observe` / :meth:`metrics` for that step."""

    def __init__(self, skipper: PromptSkipper, group_size: int) -> None:
        self.flat = FlatPrompts()
        super().__init__(skipper, group_size, self.flat, key=lambda item: prompt_id(item[0]), door="OpenRLHF")

    def take(
        self, dataloader_iter: Iterator[Any], num_prompts: int
    ) -> tuple[list[Any], list[Any], list[Any], bool]:
        """``(prompts, labels, images, exhausted)`` of the next step: ``num_prompts`` kept prompts
        (fewer when the episode runs out); ``exhausted``: nothing of the episode is left."""
        self.flat.use(dataloader_iter)
        items = self.take_round(num_prompts)
        exhausted = self.flat.drained and not self.flat.buffer and not self.draw.holds_ahead
        return [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], exhausted

    def row_weights(self, prompts: Sequence[Any]) -> torch.Tensor:
        """``[rows]`` float64: each row's weight, by the prompt it was generated for."""
        return self.weights_for([prompt_id(p) for p in prompts])

    def observe_prompts(
        self,
        prompts: Sequence[Any],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None,
    ) -> None:
        """Tell the skipper every rolled-out group of the step (``prompts``: one per row)."""
        self.observe([prompt_id(p) for p in prompts], rewards, group_index, lengths)
