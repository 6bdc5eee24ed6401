"""Prompt skipping in OpenRLHF: the prompts OpenRLHF's dataloader yields pass a grpo_parts
``PromptSkipper`` before vLLM sees them (issue 44 item 6).

OpenRLHF draws each step's prompts in its samples generator (``_generate_vllm`` reads
``rollout.batch_size`` prompts from the dataloader iterator). :class:`SkipStage` sits at that
seam: it reads the dataloader's prompts one by one into a :class:`~grpo_parts.skip.draw.PromptDraw`
(the same sampling design as ``grpo-parts train``: the drawn set and the kept count fixed before
the draw, the step keeps its size by drawing more), and only the kept prompts are generated. A
skipped prompt generates nothing and weighs 0; a kept one's rows weigh ``1 / p`` times ``rolled-out
/ drawn prompts`` (:meth:`SkipStage.row_weights`), so OpenRLHF's per-step sequence mean
(``seq-mean-token-mean``) over the rolled-out rows is the drawn batch's in expectation -- the
normaliser fixed before the draw, as in our trainer. The experience maker multiplies each row's
advantage by it (with a weighted filter, by both weights) and tells the skipper every rolled-out
group's rewards (:meth:`SkipStage.observe`).

Counters: ``parts/prompt_skip/prompts_skipped``, ``prompts_drawn``, ... (:meth:`SkipStage.metrics`).
The skipper's history travels in OpenRLHF's checkpoint ``client_states`` (``.ray_actors``).
No OpenRLHF import here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from grpo_parts.errors import GRPOPartsError
from grpo_parts.skip.draw import PromptDraw
from grpo_parts.skip.protocol import PromptId, PromptSkipper, prompt_id

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


class SkipStage:
    """The skipping stage of one OpenRLHF run: :meth:`take` a step's prompts, then
    :meth:`row_weights` / :meth:`observe` / :meth:`metrics` for that step."""

    def __init__(self, skipper: PromptSkipper, group_size: int) -> None:
        if skipper.step_size != "fill":
            raise GRPOPartsError(
                f"prompt_skip_kwargs.step_size: OpenRLHF trains whole --train.batch_size steps, got "
                f"{skipper.step_size!r}; expected 'fill' (skipped prompts are made up for by drawing more)"
            )
        self.skipper, self.group_size = skipper, group_size
        self.flat = FlatPrompts()
        self.draw: PromptDraw[Item] = PromptDraw(skipper, self.flat, key=lambda item: prompt_id(item[0]))

    def take(
        self, dataloader_iter: Iterator[Any], num_prompts: int
    ) -> tuple[list[Any], list[Any], list[Any], bool]:
        """``(prompts, labels, images, exhausted)`` of the next step: ``num_prompts`` kept prompts
        (fewer when the episode runs out); ``exhausted``: nothing of the episode is left."""
        self.flat.use(dataloader_iter)
        self.draw.rounds.clear()  # one round per step
        items = self.draw.take(num_prompts)
        exhausted = self.flat.drained and not self.flat.buffer and not self.draw.holds_ahead
        return [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], exhausted

    def prompt_weights(self) -> dict[PromptId, float]:
        """Each rolled-out prompt's row weight this step: ``1 / p`` times ``rolled-out / drawn``."""
        if not self.draw.rounds:
            return {}
        (r,) = self.draw.rounds
        scale = len(r.kept_ids) / r.drawn if r.drawn else 1.0
        return {pid: float(w) * scale for pid, w in zip(r.kept_ids, r.weights.tolist())}

    def row_weights(self, prompts: Sequence[Any]) -> torch.Tensor:
        """``[rows]`` float64: each row's weight, by the prompt it was generated for."""
        weights = self.prompt_weights()
        out: list[float] = []
        for p in prompts:
            key = prompt_id(p)
            if key not in weights:
                raise GRPOPartsError(
                    f"prompt skipping: a sample's prompt was not among this step's rolled-out prompts "
                    f"({str(key)[:60]!r}); expected OpenRLHF to keep Experience.prompts as the dataloader gave them"
                )
            out.append(weights[key])
        return torch.tensor(out, dtype=torch.float64)

    def observe(
        self,
        prompts: Sequence[Any],
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        lengths: torch.Tensor | None,
    ) -> None:
        """Tell the skipper every rolled-out group of the step (``prompts``: one per row)."""
        ids: dict[int, PromptId] = {}
        for p, g in zip(prompts, group_index.tolist()):
            ids.setdefault(int(g), prompt_id(p))
        self.skipper.observe([ids[g] for g in range(len(ids))], rewards.double(), group_index, lengths)

    def metrics(self, fallback_length: float) -> dict[str, float]:
        return self.draw.metrics(self.group_size, fallback_length)

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_skip": self.skipper.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipper.load_state_dict(state["prompt_skip"])
