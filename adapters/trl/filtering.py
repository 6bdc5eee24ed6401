"""The completion-filter seam of :class:`~.trainer.GRPOPartsTrainer`: TRL's
``_generate_and_score_completions`` (training batches only). After TRL's advantages the filter selects rows,
every per-row entry is sliced to them and the kept count rounded to ``steps_per_generation``; the old-policy /
reference forwards then run on the kept rows only. docs/adapters/trl.md, "The filter's rules"."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch

from grpo_parts.counters import (
    KEPT_FRACTION,
    NO_LOSS_ROWS,
    NUM_KEPT,
    ROUNDING,
    ROWS_SCORED,
    WEIGHTED_ROWS,
    PartCounters,
    framework_key,
)
from grpo_parts.doors.weights import kept_scale
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.filter.apply import select_rows
from grpo_parts.filter.refill import Refiller, Round
from grpo_parts.types import ScoredBatch

from .options import ROW_NORMALISED_LOSSES, TRLPartsOptions
from .rows import concat_batches, drop_no_loss_rows, round_kept
from .skipping import SkipSeam

logger = logging.getLogger(__name__)

#: the column of TRL's completions table that says whether a completion was trained on
KEPT_COLUMN = "kept"


class FilterSeam(SkipSeam):
    """``GRPOTrainer`` with the filter seam (after the prompt-skipping stage of :class:`~.skipping.SkipSeam`)
    and the helpers the other seams share; the parts are set up by :class:`~.trainer.GRPOPartsTrainer`."""

    gp_filter: Any
    parts_options: TRLPartsOptions
    parts_refused: dict[str, list[str]]
    _gp_counters: PartCounters
    _gp_off: dict[str, str]  # part -> why it does not run as asked (its calls count as fallbacks)
    _gp_deferring: bool
    _gp_deferred: list[tuple[torch.Tensor, tuple[Any, ...]]]
    _gp_rewards_per_func: torch.Tensor | None
    _gp_stream: Iterator[dict[str, Any]] | None

    def _gp_mode(self) -> str:
        return "train" if self.model is not None and self.model.training else "eval"

    def _gp_log(self, prefix: str, stats: dict[str, Any]) -> None:
        for k, v in stats.items():
            self._metrics[self._gp_mode()][framework_key(prefix, k)].append(float(v))

    def _gp_count(self, part: str, served: bool) -> None:
        """One call of ``part``: through the part, or (not served, or the part is not the one asked
        for) a fallback with its reason."""
        mode = self._gp_mode()
        if served and part not in self._gp_off:
            self._gp_counters.ran(part, mode=mode)
        elif part in self._gp_off:
            self._gp_counters.fell_back(part, self._gp_off[part], mode=mode)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gp_rewards_per_func = rewards_per_func  # gathered [N_all, F]; the filter needs the rewards
        return rewards_per_func

    def _gp_can_defer(self) -> bool:
        if not self.parts_options.defer_logprobs:
            return False
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return False  # TRL uses the old log-probs inside scoring
        model = self.accelerator.unwrap_model(self.model)
        return not (self.beta != 0.0 and self.ref_model is None and hasattr(model, "peft_config"))

    def _gp_score(self, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], ScoredBatch]:
        """TRL's generation + scoring of ``inputs`` with the no-grad forwards postponed."""
        self._gp_deferred, self._gp_deferring = [], self._gp_can_defer()
        self._gp_rewards_per_func = None
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._gp_deferring = False
        deferred: dict[str, Any] = {}
        for placeholder, call in self._gp_deferred:
            keys = [k for k, v in out.items() if v is placeholder]
            if len(keys) != 1:
                raise GRPOPartsError(
                    f"deferred log-probs: expected one batch key holding the placeholder, got {keys}"
                )
            deferred[keys[0]] = call
        self._gp_deferred = []
        n = out["completion_ids"].shape[0]
        rewards, start = self._gp_rewards(n)
        rows = torch.arange(n, device=rewards.device) + start
        lengths = self._gp_loss_mask(out).sum(-1).long()
        # a row with no loss token carries no gradient: rank it as a zero-advantage row
        advantages = out["advantages"].reshape(n, -1)[:, 0].float().masked_fill(lengths == 0, 0.0)
        scored = ScoredBatch(rewards, advantages, rows // int(self.num_generations or 1), lengths)
        return out, deferred, scored

    def _gp_rewards(self, n: int) -> tuple[torch.Tensor, int]:
        """This process's ``n`` rows' rewards (weighted sum over the reward functions, as TRL's) from
        the batch TRL just scored, and the first row's index in the gathered batch."""
        rpf = self._gp_rewards_per_func
        if rpf is None:
            raise GRPOPartsError("rewards: TRL did not call _calculate_rewards during scoring")
        start = self.accelerator.process_index * n
        return (rpf * self.reward_weights.to(rpf.device)).nansum(dim=1)[start : start + n], start

    @staticmethod
    def _gp_loss_mask(batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]

    def _gp_next_prompts(self, n: int) -> list[dict[str, Any]]:
        if self._gp_stream is None:
            self._gp_stream = self._gp_prompt_stream()
        return [next(self._gp_stream) for _ in range(n)]

    def _gp_log_kept(self, flags: list[torch.Tensor]) -> None:
        """Add the ``kept`` column to TRL's completions table (``self._logs``): one flag per row TRL
        just logged, gathered across processes in TRL's order."""
        from accelerate.utils import gather_object

        values = gather_object([bool(x) for f in flags for x in f.tolist()])
        col = self._logs["extra"][KEPT_COLUMN]  # type: ignore[index]
        missing = len(self._logs["prompt"]) - len(values) - len(col)
        if missing > 0:  # rows logged before the column existed
            col.extend([None] * missing)
        col.extend(values)

    def _gp_unfiltered(self, inputs: Any, mode: str) -> Any:
        """TRL's batch as is: no filter, or an eval batch (every row logged as kept); with prompt
        skipping every row's advantage carries its prompt's weight."""
        self._gp_rewards_per_func = None
        out = super()._generate_and_score_completions(inputs)
        if self._gp_skip is not None:
            n = out["completion_ids"].shape[0]
            lengths = self._gp_loss_mask(out).sum(-1).long()
            self._gp_log("prompt_skip", self._gp_skip_observe(self._gp_rewards(n)[0], lengths))
            out["advantages"] = _times_rows(out["advantages"], self._gp_skip)
        if mode == "train":
            self._gp_count("filter", served=False)
        elif self.gp_filter is not None:  # eval batches are not filtered: every row counts
            self._gp_log_kept([torch.ones(out["completion_ids"].shape[0], dtype=torch.bool)])
        return out

    def _gp_refill(
        self, rounds: list[Round[Any]], n: int, g: int
    ) -> tuple[list[torch.Tensor], dict[str, Any], list[torch.Tensor | None]]:
        """Kept rows per round and the refill's info: round 1 is the batch TRL's dataloader gave us
        (``rounds[0]``), later rounds score more prompts from the stream (appended to ``rounds``)."""
        opts = self.parts_options

        def produce(num_prompts: int) -> Round[Any] | None:
            if not produced:  # round 1 is the batch TRL's dataloader gave us
                produced.append(True)
                return rounds[0]
            extra = [copy.deepcopy(row) for row in self._gp_next_prompts(num_prompts) for _ in range(g)]
            o, d, s = self._gp_score(extra)
            rounds.append(Round((o, d), s, num_prompts))
            return rounds[-1]

        produced: list[bool] = []
        refiller = Refiller(
            target_size=opts.refill_target_size or n,
            initial_prompts=rounds[0].num_prompts,
            max_rounds=1 + self.parts_config.refill_rounds,
            max_prompts=opts.max_refill_prompts,
        )
        outcome = refiller.fill(self.gp_filter, produce)
        by_round = {id(sel.round): sel for sel in outcome.selections}
        kept = [
            by_round[id(c)].kept if id(c) in by_round else torch.zeros(0, dtype=torch.long) for c in rounds
        ]
        weights = [by_round[id(c)].weights if id(c) in by_round else None for c in rounds]
        for _ in rounds:
            self._gp_count("filter", served=True)
        return kept, dict(outcome.info), weights

    def _gp_select(
        self, rounds: list[Round[Any]], g: int, mode: str
    ) -> tuple[list[torch.Tensor], dict[str, Any], list[torch.Tensor | None]]:
        """Kept rows per round, the filter's info and its importance weights of the kept rows per
        round (None: unweighted): every row when the filter refuses the batch (unless strict), else
        the filter's choice, refilled when ``refill`` is on."""
        scored = rounds[0].scored
        n = scored.size
        reasons = list(self.gp_filter.not_supported_reasons(scored))
        if reasons:
            if self.parts_options.strict:
                raise NotSupportedError(f"filter {self.gp_filter.name!r}", reasons)
            self._gp_counters.fell_back("filter", "; ".join(reasons), mode=mode)
            return [torch.arange(n, device=scored.rewards.device)], {}, [None]
        if self.parts_config.refill_rounds:
            return self._gp_refill(rounds, n, g)
        res = self.gp_filter.select(scored, None)
        self._gp_count("filter", served=True)
        return [res.kept], dict(res.info), [res.weights]

    def _gp_kept_parts(
        self, rounds: list[Round[Any]], kept: list[torch.Tensor]
    ) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
        """Each round's batch sliced to its kept rows, with the postponed no-grad forwards run on
        those rows only; and each round's kept flag per row (for the completions table)."""
        parts, flags = [], []
        for rnd, rows in zip(rounds, kept):
            flag = torch.zeros(rnd.scored.size, dtype=torch.bool)
            flag[rows.cpu()] = True
            flags.append(flag)
            if rows.numel() == 0:
                continue
            batch, calls = rnd.payload
            sub = select_rows(batch, rows, rnd.scored.size)
            for key, (model, ids, mask, keep, bs, mm) in calls.items():
                idx = rows.to(ids.device)
                images = select_rows(mm, rows, rnd.scored.size)  # each kept row's own images
                with torch.no_grad():
                    sub[key] = self._get_per_token_logps_and_entropies(
                        model, ids[idx], mask[idx], keep, bs, **images
                    )[0]
            parts.append(sub)
        return parts, flags

    def _gp_weigh(
        self, batch: dict[str, Any], weights: list[torch.Tensor], total: int, rescale: bool
    ) -> float:
        """Multiply the kept rows' advantages by their weights (``weights``: per round, in the kept
        batch's row order), times ``kept / scored rows`` (``rescale``: a weighted filter) for the losses
        TRL normalises by the micro-batch's row count; returns how many rows carry a weight (> 0)."""
        w = torch.cat(weights).to(torch.float64)
        if rescale and self.loss_type in ROW_NORMALISED_LOSSES:
            w = w * kept_scale(w.numel(), total)
        batch["advantages"] = _times_rows(batch["advantages"], w)
        return float((w > 0).sum())

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        mode = self._gp_mode()
        if self._gp_stage is not None and mode == "train":
            inputs = self._gp_skip_prompts(inputs)
        try:
            if self.gp_filter is None or mode != "train":
                return self._gp_unfiltered(inputs, mode)
            return self._gp_filtered(inputs, mode)
        finally:
            self._gp_skip = None

    def _gp_row_weights(
        self, rounds: list[Round[Any]], kept: list[torch.Tensor], drawn: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Every scored row's weight per round (empty: none): a weighted filter's ``1 / p`` (0 for
        rows not drawn: rows the rounding re-adds train with weight 0), times the prompt skipper's."""
        weighted = any(w is not None for w in drawn)
        if not weighted and self._gp_skip is None:
            return []
        row_w = [
            _row_weights(c.scored.size, k, w) if weighted else torch.ones(c.scored.size, dtype=torch.float64)
            for c, k, w in zip(rounds, kept, drawn)
        ]
        if self._gp_skip is not None:  # one round: refill is refused with skipping
            row_w[0] = row_w[0] * self._gp_skip
        return row_w

    def _gp_filtered(self, inputs: Any, mode: str) -> Any:
        """TRL's batch scored, filtered (and refilled), sliced to the kept rows and weighted."""
        g = int(self.num_generations or 1)
        out, deferred, scored = self._gp_score(inputs)
        if self._gp_skip is not None:
            lengths = self._gp_loss_mask(out).sum(-1).long()
            self._gp_log("prompt_skip", self._gp_skip_observe(scored.rewards, lengths))
        rounds: list[Round[Any]] = [Round((out, deferred), scored, max(1, scored.size // g))]
        kept, info, drawn = self._gp_select(rounds, g, mode)
        weighted = any(w is not None for w in drawn)
        row_w = self._gp_row_weights(rounds, kept, drawn)
        no_loss: list[torch.Tensor] = [self._gp_loss_mask(c.payload[0]).sum(-1) == 0 for c in rounds]
        kept = drop_no_loss_rows(kept, no_loss)
        spg = self.args.steps_per_generation  # type: ignore[attr-defined]
        down = self.parts_config.kept_rounding == "down" and not weighted  # dropping drawn rows: biased
        kept, changed = round_kept([c.scored for c in rounds], kept, spg, "down" if down else "up", no_loss)
        parts, flags = self._gp_kept_parts(rounds, kept)
        self._gp_log_kept(flags)
        batch = concat_batches(parts, int(self._tokenizer.pad_token_id))
        total = sum(c.scored.size for c in rounds)
        num_kept = int(batch["completion_ids"].shape[0])
        # the loss tokens TRL normalises by: the kept rows' (plain filters), every scored row's (weighted)
        tokens = sum(self._gp_loss_mask(c.payload[0]).sum() for c in rounds) if weighted else None
        batch["num_items_in_batch"] = self.accelerator.gather(
            self._gp_loss_mask(batch).sum() if tokens is None else tokens
        ).sum()
        if row_w:
            n_weighted = self._gp_weigh(
                batch, [w[k.cpu()] for w, k in zip(row_w, kept) if k.numel()], total, weighted
            )
            if weighted:
                info[WEIGHTED_ROWS] = n_weighted
        info.update(
            {KEPT_FRACTION: num_kept / total, NUM_KEPT: num_kept, ROWS_SCORED: total, ROUNDING: changed}
        )
        info[NO_LOSS_ROWS] = float(sum(int(d.sum()) for d in no_loss))
        self._gp_log("filter", info)
        return batch


def _times_rows(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``values: [K]`` or per-token ``[K, T]`` times the row weights ``w: [K]`` (in float64)."""
    shape = (-1,) + (1,) * (values.ndim - 1)
    return (values.to(torch.float64) * w.to(values.device).reshape(shape)).to(values.dtype)


def _row_weights(n: int, kept: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[n]`` float64 on the CPU: the filter's weight of each kept row (1 when unweighted), 0 elsewhere."""
    out = torch.zeros(n, dtype=torch.float64)
    out[kept.cpu()] = 1.0 if weights is None else weights.detach().cpu().to(torch.float64)
    return out
