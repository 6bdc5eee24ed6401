"""Refill (CPPO's dynamic allocation): turn pruned slots into more prompts until the kept batch is full.

:class:`Refiller` works for any pruning rate and any filter: round 1 rolls out ``initial_prompts``,
each further round the ``extra_prompts_wanted`` the filter asks for, and the overshoot is trimmed
from the last round only, by priority (docs/filter.md, "Refill"). A weighted result (``dppo``) ends
the fill after its round, untrimmed: a trim by priority, or a refill round whose number depends on
the draw, would bias the importance-weighted estimate.

:meth:`Refiller.fill` is framework-agnostic (``produce(n) -> Round | None``, any payload);
:func:`fill_rollouts` wires it to a prompt iterator, a sampler callable and a reward function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..core import AdvantageConfig, group_advantages, kl_shaped_rewards
from ..errors import GRPOPartsError, check_tensor
from ..skip.protocol import DrawsPrompts
from ..types import Rollout, VisionInputs
from ._common import extra_prompts, num_groups_present, priority_order
from .apply import KeptBatch, loss_denominators
from .protocol import KEPT_FRACTION, CompletionFilter, ScoredBatch

T = TypeVar("T")
P = TypeVar("P")


@dataclass(frozen=True)
class Round(Generic[T]):
    """One round's rollout: ``payload`` (anything), its ``scored`` rows and how many prompts it used."""

    payload: T
    scored: ScoredBatch
    num_prompts: int


@dataclass(frozen=True)
class Selection(Generic[T]):
    """Rows ``kept`` (ascending) of ``round.payload`` to train on, with the filter's importance
    ``weights`` of those rows (``[len(kept)]``; None = all 1)."""

    round: Round[T]
    kept: torch.Tensor
    weights: torch.Tensor | None = None


@dataclass(frozen=True)
class RefillOutcome(Generic[T]):
    selections: list[Selection[T]]
    num_kept: int
    target_size: int
    rounds: int
    prompts_used: int
    rows_generated: int
    info: dict[str, float] = field(default_factory=dict)

    @property
    def filled(self) -> bool:
        return self.num_kept == self.target_size

    @property
    def is_empty(self) -> bool:
        return self.num_kept == 0


class Refiller(BaseModel):
    """Fill a kept batch of exactly ``target_size`` rows (see module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_size: int = Field(..., ge=1, description="kept rows wanted (e.g. B * G of the unpruned run)")
    initial_prompts: int = Field(..., ge=1, description="prompts in round 1 (B, or ceil(B / (1 - P)))")
    max_rounds: int = Field(16, ge=1)
    max_prompts: int | None = Field(None, ge=1, description="cap on prompts pulled per fill")

    def fill(self, filt: CompletionFilter, produce: Callable[[int], Round[T] | None]) -> RefillOutcome[T]:
        selections: list[Selection[T]] = []
        kept_total = prompts_used = rows = rounds = 0
        want = self.initial_prompts
        while kept_total < self.target_size and rounds < self.max_rounds:
            if self.max_prompts is not None:
                want = min(want, self.max_prompts - prompts_used)
            if want <= 0:
                break
            rolled = produce(want)
            if rolled is None or rolled.scored.size == 0:
                break  # stream exhausted
            rounds += 1
            prompts_used += rolled.num_prompts
            rows += rolled.scored.size
            deficit = self.target_size - kept_total
            res = filt.select(rolled.scored, target_size=deficit)
            kept = res.kept
            if res.weights is None and kept.numel() > deficit:  # trim overshoot by priority
                order = priority_order(rolled.scored)
                is_kept = torch.zeros(rolled.scored.size, dtype=torch.bool, device=order.device)
                is_kept[kept.to(order.device)] = True
                kept = torch.sort(order[is_kept[order]][:deficit]).values
            if kept.numel():
                selections.append(Selection(rolled, kept, res.weights))
            kept_total += int(kept.numel())
            if res.weights is not None:
                break  # a weighted draw: no trim and no refill (both would bias it)
            nominal = rolled.scored.size / max(1, rolled.num_prompts)
            want = res.extra_prompts_wanted or extra_prompts(
                int(res.kept.numel()), deficit, num_groups_present(rolled.scored), nominal
            )
        info = {"rounds": float(rounds), "prompts_used": float(prompts_used), "rows_generated": float(rows)}
        info[KEPT_FRACTION] = kept_total / rows if rows else 0.0
        return RefillOutcome(selections, kept_total, self.target_size, rounds, prompts_used, rows, info)


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int = 0) -> Rollout:
    """Stack rollouts with different widths: prompts re-left-padded, completions re-right-padded;
    ``group_index`` is offset so that groups of different rollouts stay distinct."""
    if not rollouts:
        raise GRPOPartsError("rollouts: expected at least one Rollout, got an empty list")
    pw = max(r.prompt_ids.shape[1] for r in rollouts)
    tw = max(r.completion_ids.shape[1] for r in rollouts)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("pi", "pm", "ci", "cm", "lp", "gi")}
    offset = 0
    for r in rollouts:
        dp, dt = pw - r.prompt_ids.shape[1], tw - r.completion_ids.shape[1]
        pad = torch.nn.functional.pad
        parts["pi"].append(pad(r.prompt_ids, (dp, 0), value=pad_token_id))
        parts["pm"].append(pad(r.prompt_mask, (dp, 0), value=0))
        parts["ci"].append(pad(r.completion_ids, (0, dt), value=pad_token_id))
        parts["cm"].append(pad(r.completion_mask, (0, dt), value=0))
        parts["lp"].append(pad(r.logprobs, (0, dt), value=0.0))
        parts["gi"].append(r.group_index + offset)
        offset += r.num_prompts
    cat = {k: torch.cat(v) for k, v in parts.items()}
    # the images follow their prompts' new numbering (a rollout without images: none per prompt)
    vision = None
    if any(r.vision is not None for r in rollouts):
        per = [r.vision.per_prompt if r.vision is not None else ({},) * r.num_prompts for r in rollouts]
        vision = VisionInputs(tuple(v for p in per for v in p))
    return Rollout(cat["pi"], cat["pm"], cat["ci"], cat["cm"], cat["lp"], cat["gi"], offset, vision=vision)


@dataclass(frozen=True, kw_only=True)
class FilledBatch(KeptBatch, Generic[P]):
    """The kept rows of every round, concatenated: a :class:`~grpo_parts.filter.apply.KeptBatch` plus the
    rounds' bookkeeping. ``kept`` indexes the rows of every round's rollout concatenated in order;
    ``rollout.group_index`` numbers the prompts that kept at least one row, ``0 .. len(prompts) - 1``.
    ``full_group``: each kept row's prompt among *every* rolled-out prompt (all rounds, stream order), and
    ``group_rows`` / ``group_seqs`` / ``group_tokens`` (``[P_all]``) count each rolled-out prompt's rows,
    rows with a completion token, and completion tokens, pruned or not: the whole batch's loss denominators
    per prompt, known before the draw (what :mod:`grpo_parts.train.step.minibatches` splits)."""

    prompts: list[P]
    outcome: RefillOutcome[Any]
    full_group: torch.Tensor | None = None  # [K]
    group_rows: torch.Tensor | None = None  # [P_all]
    group_seqs: torch.Tensor | None = None  # [P_all]
    group_tokens: torch.Tensor | None = None  # [P_all]


def group_counts(rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, rows with a token, tokens)`` of each prompt of ``rollouts`` (numbered across them in
    order, as :func:`concat_rollouts` does), each ``[sum of num_prompts]`` float64 on the CPU."""
    out: list[list[torch.Tensor]] = [[], [], []]
    for r in rollouts:
        gi = r.group_index.cpu()
        tokens = r.completion_mask.cpu().to(torch.float64).sum(-1)
        for acc, per_row in zip(out, (torch.ones_like(tokens), (tokens > 0).to(torch.float64), tokens)):
            acc.append(torch.zeros(r.num_prompts, dtype=torch.float64).index_add_(0, gi, per_row))
    empty = torch.zeros(0, dtype=torch.float64)
    rows, seqs, toks = (torch.cat(x) if x else empty for x in out)
    return rows, seqs, toks


def _take(prompts: Iterator[P], n: int) -> list[P]:
    """Up to ``n`` prompts from the stream (fewer when it runs out); a stream that draws a round at
    once (a prompt skipper's :class:`~grpo_parts.skip.draw.PromptDraw`) hands out its round."""
    if isinstance(prompts, DrawsPrompts):
        return list(prompts.take(n))
    return list(itertools.islice(prompts, n))


def _score_round(
    batch: list[P],
    rollout: Rollout,
    reward: Callable[[list[P], Rollout], torch.Tensor],
    cfg: AdvantageConfig,
    kl_logprobs: Callable[[Rollout], tuple[torch.Tensor, torch.Tensor | None]] | None,
) -> Round[tuple[list[P], Rollout, torch.Tensor, torch.Tensor]]:
    """One round's rollout of ``batch``, scored: rewards (KL-shaped when ``cfg.kl_coef > 0``) and
    group advantages; the payload keeps the raw rewards and the advantages for the kept rows."""
    if rollout.num_prompts != len(batch):
        raise GRPOPartsError(
            f"sample: expected a Rollout of {len(batch)} prompts, got num_prompts={rollout.num_prompts}"
        )
    r = check_tensor("reward(...)", reward(batch, rollout), shape=[rollout.num_completions], dtype="float")
    old, ref = kl_logprobs(rollout) if cfg.kl_coef > 0 and kl_logprobs is not None else (None, None)
    shaped = kl_shaped_rewards(r, rollout.completion_mask, cfg, old, ref)
    lengths = rollout.completion_lengths()
    adv = group_advantages(shaped, rollout.group_index, cfg, num_groups=rollout.num_prompts, lengths=lengths)
    scored = ScoredBatch(shaped, adv, rollout.group_index, lengths)
    return Round((batch, rollout, r, adv), scored, len(batch))


def _merge_selections(
    outcome: RefillOutcome[Any], pad_token_id: int, rolled: Sequence[Rollout]
) -> FilledBatch[Any]:
    """The kept rows of every round in one :class:`FilledBatch` (``outcome`` not empty);
    ``rolled``: every round's rollout, in order (for the whole batch's counts)."""
    subs: list[Rollout] = []
    rewards: list[torch.Tensor] = []
    advs: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    full: list[torch.Tensor] = []
    kept_rows: list[torch.Tensor] = []
    kept_prompts: list[Any] = []
    offsets, row_offsets, start, row = {}, {}, 0, 0
    for r in rolled:
        offsets[id(r)], start = start, start + r.num_prompts
        row_offsets[id(r)], row = row, row + r.num_completions
    for sel in outcome.selections:
        batch, rollout, r, adv = sel.round.payload
        sub = rollout.select(sel.kept)
        # compact group ids to the prompts that kept rows, in stream order
        compact, used = sub.compact_prompts()
        kept_prompts.extend(batch[i] for i in used.tolist())
        subs.append(replace(compact, stats=dict(rollout.stats)))
        rewards.append(r[sel.kept])
        advs.append(adv[sel.kept])
        w = sel.weights
        weights.append(torch.ones(sel.kept.numel(), dtype=torch.float64) if w is None else w.cpu().double())
        full.append(sub.group_index + offsets[id(rollout)])
        kept_rows.append(sel.kept.cpu() + row_offsets[id(rollout)])
    merged = concat_rollouts(subs, pad_token_id)
    weighted = any(sel.weights is not None for sel in outcome.selections)
    rows, seqs, toks = group_counts(rolled)
    own_tokens, own_seqs = loss_denominators(merged.completion_mask)
    return FilledBatch(
        rollout=merged, advantages=torch.cat(advs), kept=torch.cat(kept_rows),
        num_tokens=float(toks.sum()) if weighted else own_tokens,
        num_seqs=float(seqs.sum()) if weighted else own_seqs,
        rewards=torch.cat(rewards),
        weights=torch.cat(weights).to(merged.completion_ids.device) if weighted else None,
        prompts=kept_prompts, outcome=outcome, full_group=torch.cat(full),
        group_rows=rows, group_seqs=seqs, group_tokens=toks,
    )  # fmt: skip


def fill_rollouts(
    filt: CompletionFilter,
    refiller: Refiller,
    prompts: Iterator[P],
    sample: Callable[[list[P]], Rollout],
    reward: Callable[[list[P], Rollout], torch.Tensor],
    advantage_config: AdvantageConfig | None = None,
    pad_token_id: int = 0,
    kl_logprobs: Callable[[Rollout], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> FilledBatch[P]:
    """Pull prompts, ``sample`` them (one :class:`Rollout` per round), score with ``reward(prompts,
    rollout) -> [N]``, compute group advantages, filter and refill to ``refiller.target_size``. The
    advantages that rank the rows are the ones trained on (batch statistics: each round's). With KL in
    the reward, ``kl_logprobs(rollout) -> (old, ref)`` gives every row's log-probs before filtering, so
    the filter sees the KL-penalised rewards the estimator saw."""
    cfg = advantage_config or AdvantageConfig()
    if cfg.kl_coef > 0 and kl_logprobs is None:
        raise GRPOPartsError(
            "kl_logprobs: expected a callable because advantage_config.kl_coef > 0, got None"
        )

    rolled: list[Rollout] = []  # every round's rollout, pruned rows included

    def produce(n: int) -> Round[tuple[list[P], Rollout, torch.Tensor, torch.Tensor]] | None:
        batch = _take(prompts, n)
        if not batch:
            return None
        rolled.append(sample(batch))
        return _score_round(batch, rolled[-1], reward, cfg, kl_logprobs)

    outcome = refiller.fill(filt, produce)
    if outcome.is_empty:
        empty = torch.zeros(0)
        rows, seqs, toks = group_counts(rolled)
        return FilledBatch(
            rollout=None, advantages=empty, kept=torch.zeros(0, dtype=torch.long), num_tokens=0.0,
            num_seqs=0.0, rewards=empty, prompts=[], outcome=outcome,
            group_rows=rows, group_seqs=seqs, group_tokens=toks,
        )  # fmt: skip
    return _merge_selections(outcome, pad_token_id, rolled)
