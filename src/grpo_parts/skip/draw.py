"""Drawing prompts past a :class:`~.protocol.PromptSkipper`: :meth:`PromptDraw.take` draws the prompts
whose inclusion probabilities fit in ``n`` and keeps exactly ``n`` by systematic sampling, each
carrying ``1 / p_i``; the drawn set (the round's full batch, the normaliser) never depends on the skip
draw, or the estimate is biased: docs/filter.md, "A round: drawn before skipping, topped up to `n`".

:class:`PromptDraw` is framework-agnostic (any prompt type and id function); the trainer hands it to
:func:`grpo_parts.filter.refill.fill_rollouts` as its prompt stream and afterwards reads each
rolled-out prompt's weight, the normaliser scale ``drawn / rolled out`` and the skip metrics from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ..counters import PROMPTS_DRAWN, PROMPTS_SKIPPED
from ..errors import GRPOPartsError
from .protocol import PeeksPrompts, PromptId, PromptSkipper, ReportsHistory

__all__ = ["PromptDraw", "SkipRound"]

P = TypeVar("P")
_EPS = 1e-9


@dataclass(frozen=True)
class SkipRound:
    """One round of a :class:`PromptDraw`: ``kept_ids`` (rolled out, stream order) with their
    ``weights`` (``[K]`` float64, ``1 / p``), how many prompts were ``drawn``, and the ids skipped."""

    kept_ids: list[PromptId]
    weights: torch.Tensor
    drawn: int
    skipped_ids: list[PromptId] = field(default_factory=list)


class PromptDraw(Iterator[P], Generic[P]):
    """A prompt stream that skips through ``skipper``: :meth:`take` hands out a round (module
    docstring); ``key(prompt) -> PromptId``. Also a plain iterator (a round of one per ``next``)."""

    def __init__(self, skipper: PromptSkipper, stream: Iterator[P], key: Callable[[P], PromptId]):
        if not 0.0 < skipper.min_keep_prob <= 1.0:
            raise GRPOPartsError(
                f"min_keep_prob: expected a value in (0, 1] (no prompt skipped forever), got {skipper.min_keep_prob}"
            )
        self.skipper, self.stream, self.key = skipper, stream, key
        self.rounds: list[SkipRound] = []
        self._ahead: tuple[P] | None = None  # the prompt read ahead (a stream without peek())

    def __next__(self) -> P:
        got = self.take(1)
        if not got:
            raise StopIteration
        return got[0]

    def _peek(self) -> P | None:
        """The stream's next prompt, not consumed (None: the stream ran out)."""
        if isinstance(self.stream, PeeksPrompts):
            try:
                return self.stream.peek()
            except StopIteration:
                return None
        if self._ahead is None:
            try:
                self._ahead = (next(self.stream),)
            except StopIteration:
                return None
        return self._ahead[0]

    def _consume(self) -> None:
        if isinstance(self.stream, PeeksPrompts):
            next(self.stream)
        else:
            self._ahead = None

    def _draw(self, n: int) -> tuple[list[P], list[PromptId]]:
        """Prompts from the stream while the next one's probability fits (sum ``<= n``)."""
        drawn: list[P] = []
        ids: list[PromptId] = []
        total = 0.0
        while total < n - _EPS:
            x = self._peek()
            if x is None:
                break
            pid = self.key(x)
            p = self.skipper.inclusion_probability(pid)
            if total + p > n + _EPS:
                break  # it does not fit: it stays in the stream for the next round
            self._consume()
            drawn.append(x)
            ids.append(pid)
            total += p
        return drawn, ids

    def _draw_exactly(self, n: int) -> tuple[list[P], list[PromptId], float]:
        """``n`` prompts from the stream (fewer when it runs out), whatever their probabilities, and
        the round's target: their probabilities' sum, at least 1 (a round never rolls out nothing)
        and at least the skipper's ``min_rollout_share`` of them. Both are fixed before the draw."""
        drawn: list[P] = []
        ids: list[PromptId] = []
        while len(drawn) < n:
            x = self._peek()
            if x is None:
                break
            self._consume()
            drawn.append(x)
            ids.append(self.key(x))
        total = sum(self.skipper.inclusion_probability(i) for i in ids)
        floor = max(1.0, self.skipper.min_rollout_share * len(ids))
        return drawn, ids, min(float(len(ids)), max(floor, total))

    def take(self, n: int) -> list[P]:
        """Prompts to roll out, in stream order. ``step_size="fill"``: exactly ``n`` unless the stream
        ran out (more are drawn to make up for the skipped); ``"fewer"``: ``n`` are drawn and the
        kept ones -- about their probabilities' sum -- rolled out."""
        if n <= 0:
            return []
        if self.skipper.step_size == "fewer":
            drawn, ids, target = self._draw_exactly(n)
        else:
            drawn, ids = self._draw(n)
            target = float(min(n, len(ids)))
        if not drawn:
            return []
        d = self.skipper.decide(ids, target=target)
        kept = d.kept.tolist()
        weights = (
            torch.ones(len(kept), dtype=torch.float64) if d.weights is None else d.weights.cpu().double()
        )
        skipped = [ids[i] for i in d.skipped.tolist()]
        self.rounds.append(SkipRound([ids[i] for i in kept], weights, len(drawn), skipped))
        return [drawn[i] for i in kept]

    @property
    def holds_ahead(self) -> bool:
        """Whether a prompt read from the stream waits for the next round (one that did not fit)."""
        return self._ahead is not None

    @property
    def num_drawn(self) -> int:
        return sum(r.drawn for r in self.rounds)

    @property
    def num_rolled(self) -> int:
        return sum(len(r.kept_ids) for r in self.rounds)

    def prompt_weights(self) -> torch.Tensor:
        """``[rolled-out prompts]`` float64: each rolled-out prompt's ``1 / p``, rounds in order (the
        numbering of :attr:`grpo_parts.filter.refill.FilledBatch.full_group`)."""
        if not self.rounds:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([r.weights for r in self.rounds])

    def normaliser_scale(self) -> float:
        """``drawn / rolled out``: multiplies the sequence count the loss would use for the rolled-out
        rows, so that it becomes the drawn prompts' (``drawn * G`` with every row kept)."""
        return self.num_drawn / self.num_rolled if self.num_rolled else 1.0

    def observe(
        self,
        rewards: Sequence[torch.Tensor],
        group_index: Sequence[torch.Tensor],
        lengths: Sequence[torch.Tensor],
    ) -> None:
        """Tell the skipper every rolled-out group of the fill at once (one adaptation per step):
        per round that rolled something out, its raw ``rewards: [N_r]``, ``group_index: [N_r]`` and
        completion ``lengths: [N_r]`` (the round's rollout)."""
        rounds = [r for r in self.rounds if r.kept_ids]
        if len(rounds) != len(rewards) or len(rounds) != len(group_index) or len(rounds) != len(lengths):
            raise GRPOPartsError(
                f"observe: expected one rewards/group_index/lengths per rolled-out round ({len(rounds)}), "
                f"got {len(rewards)}/{len(group_index)}/{len(lengths)}"
            )
        if not rounds:
            return
        ids: list[PromptId] = []
        gis: list[torch.Tensor] = []
        for r, gi in zip(rounds, group_index):
            gis.append(gi.cpu().long() + len(ids))
            ids.extend(r.kept_ids)
        flat = [torch.cat([x.detach().cpu() for x in xs]) for xs in (rewards, lengths)]
        self.skipper.observe(ids, flat[0].double(), torch.cat(gis), flat[1])

    def metrics(self, group_size: int, fallback_length: float) -> dict[str, float]:
        """``prompts_drawn``, ``prompts_skipped``, ``skip_rollout_tokens_saved`` (each skipped prompt
        x ``group_size`` x its recent mean completion length, ``fallback_length`` without one) and the
        skipper's own ``skip_*`` diagnostics (``skip_history_size``, ...)."""
        skipped = [pid for r in self.rounds for pid in r.skipped_ids]
        history = self.skipper if isinstance(self.skipper, ReportsHistory) else None
        saved = 0.0
        for pid in skipped:
            length = None if history is None else history.mean_completion_length(pid)
            saved += group_size * (fallback_length if length is None else length)
        weights = self.prompt_weights()
        out = {
            PROMPTS_DRAWN: float(self.num_drawn),
            PROMPTS_SKIPPED: float(len(skipped)),
            "skip_rollout_tokens_saved": saved,
            "skip_max_weight": float(weights.max()) if weights.numel() else 0.0,
        }
        if history is not None:
            out.update({f"skip_{k}": v for k, v in history.history_stats().items()})
        return out
