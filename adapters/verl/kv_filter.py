"""The grpo_parts filter on one sampled verl v1 batch (TransferQueue), the core of the one filter seam
(:class:`~.sampler.FilteringReplayBuffer`): scored on full groups, filtered, refilled, rounded to
whole mini-batches on every rank, the dropped rows cleared from TransferQueue and each kept row's
full-group advantage stored beside it (``grpo_parts_seq_advantage``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from grpo_parts.counters import (
    EMPTY_BATCH_STEPS,
    ROWS_KEPT,
    SCORE_MEAN_ROLLED_OUT,
    TARGET_ROWS,
    WEIGHTED_ROWS,
    framework_keys,
)
from grpo_parts.doors.weights import weighted_rows
from grpo_parts.errors import NotSupportedError
from grpo_parts.filter.protocol import CompletionFilter
from grpo_parts.filter.refill import Refiller, Round
from grpo_parts.filter.rounding import round_kept_rows

from .filtering import FilterOptions, scored_batch, weighted_filter_reasons
from .skipping import VerlSkipStage

logger = logging.getLogger(__name__)

#: Fields the v1 filter reads from TransferQueue.
KV_FIELDS = ("uid", "rm_scores", "response_mask")
#: Per-row field the v1 filter writes: the GRPO advantage of the row within its *full* group.
SEQ_ADV_FIELD = "grpo_parts_seq_advantage"


def rewards_from_fields(fields: Any) -> tuple[torch.Tensor, list[Any], torch.Tensor]:
    """TransferQueue fields (nested or padded) -> ``rewards [B]``, ``uid``, ``response_mask [B, T]``."""
    td = fields.to_padded_tensor() if hasattr(fields, "to_padded_tensor") else fields
    scores, mask = td["rm_scores"], td["response_mask"]
    uid = td["uid"]
    uid = uid.tolist() if hasattr(uid, "tolist") else list(uid)
    return scores.float().sum(-1), uid, mask


def check_weighted(filt: CompletionFilter, options: FilterOptions | None) -> None:
    """Refuse, in one line, a weighted filter (``dppo``) under settings verl cannot keep unbiased."""
    reasons = weighted_filter_reasons(filt, options) if options is not None else []
    if reasons:
        raise NotSupportedError(
            f"grpo_parts filter {options.name!r}" if options else "grpo_parts filter", reasons
        )


def _kept_by_round(outcome: Any, options: FilterOptions) -> dict[int, set[int]]:
    """Kept row indices per round's payload (by ``id``), rounded so that the total over all rounds
    fills whole mini-batches on every rank (no padding rows). A weighted draw is not rounded (that
    would re-rank its rows): verl pads it with no-op rows, which :func:`grpo_parts.doors.weights.kept_scale` counts."""
    if any(sel.weights is not None for sel in outcome.selections):
        return {id(sel.round.payload): set(sel.kept.tolist()) for sel in outcome.selections}
    rounded = round_kept_rows(
        [sel.round.scored for sel in outcome.selections],
        [sel.kept for sel in outcome.selections],
        options.batch_multiple,
        options.kept_rounding,
        field="grpo_parts_filter.multiple_of",
    )
    return {id(sel.round.payload): set(rows.tolist()) for sel, rows in zip(outcome.selections, rounded)}


def _filter_metrics(
    outcome: Any, weighted: list[Any], kept: int, target: int, empty: bool, scores: list[torch.Tensor]
) -> dict[str, float]:
    counts = {**outcome.info, ROWS_KEPT: kept, EMPTY_BATCH_STEPS: empty, TARGET_ROWS: target}
    if scores:  # every rolled-out row's reward: verl's own critic/score is over the kept rows
        counts[SCORE_MEAN_ROLLED_OUT] = float(torch.cat(scores).mean())
    if weighted:  # the rows trained with a weight (dppo)
        counts[WEIGHTED_ROWS] = sum(sel.kept.numel() for sel in weighted)
    return framework_keys("filter", counts)


def _keep_something(
    kept: dict[int, set[int]], rounds: list[KVBatchMeta], outcome: Any, options: FilterOptions
) -> bool:
    """verl cannot train an empty batch (its balancer asserts): when the filter keeps nothing --
    every group zero-variance, so every advantage is 0 -- keep the first whole mini-batch of rows
    (zero advantage: the update moves nothing a full batch would not). Returns whether it did."""
    if any(kept.values()) or not rounds or any(sel.weights is not None for sel in outcome.selections):
        return False
    n = min(len(rounds[0].keys), max(1, options.batch_multiple))
    kept[id(rounds[0])] = set(range(n))
    logger.warning("grpo_parts filter kept no row (all advantages 0); training %d zero-advantage rows", n)
    return True


def _store_kept(b: KVBatchMeta, kept: set[int], advantages: torch.Tensor | None, store: Any) -> list[int]:
    """Clear ``b``'s dropped rows from ``store`` and put the full-group advantages of its kept rows
    (restored after verl's ``_compute_advantage``, see the trainer); returns the kept rows, sorted."""
    dropped = [k for i, k in enumerate(b.keys) if i not in kept]
    if dropped:
        store.kv_clear(keys=dropped, partition_id=b.partition_id)
    kept_rows = sorted(kept)
    if kept_rows:
        assert advantages is not None
        adv = advantages[torch.tensor(kept_rows)].float()
        fields = TensorDict({SEQ_ADV_FIELD: adv}, batch_size=[len(kept_rows)])
        store.kv_batch_put(keys=[b.keys[i] for i in kept_rows], partition_id=b.partition_id, fields=fields)
    return kept_rows


def _full_groups(
    scored: Any, uid: list[Any], kept_rows: list[int], advantages: torch.Tensor, weighted: bool
) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """``{uid: (rewards, advantages)}`` of the full group of every uid with a kept row; with a
    weighted draw (``advantages`` weighted, 0 off the draw) of its kept rows only -- rows of one
    group with equal rewards have equal weights, so the estimator's lookup by reward is exact."""
    groups = {}
    for g in dict.fromkeys(uid[i] for i in kept_rows):
        rows = torch.tensor([j for j in (kept_rows if weighted else range(len(uid))) if uid[j] == g])
        groups[g] = (scored.rewards[rows].detach().cpu(), advantages[rows].detach().cpu())
    return groups


def _train_advantages(sel: Any, options: FilterOptions) -> tuple[torch.Tensor, Any]:
    """``(advantages to train on [N], scored)`` of one selection: the GRPO advantages, or for a
    weighted draw each kept row's advantage x weight x padded kept / rolled-out rows."""
    scored = sel.round.scored
    if sel.weights is None:
        return scored.advantages, scored
    n, k = scored.size, int(sel.kept.numel())
    return scored.advantages.detach().cpu().double() * weighted_rows(
        n, sel.kept, sel.weights, k, options.batch_multiple
    ), scored


def _refiller(batch: KVBatchMeta, target: int, options: FilterOptions, more: Any) -> Refiller:
    return Refiller(
        target_size=target,
        initial_prompts=max(1, len({t.get("uid", k) for k, t in zip(batch.keys, batch.tags)})),
        max_rounds=1 + (options.refill_rounds if more is not None else 0),
    )


def _round_advantages(
    b: KVBatchMeta, train_adv: dict[int, Any], empty: bool, skip: VerlSkipStage | None, uid: list[Any]
) -> tuple[torch.Tensor | None, Any]:
    """``(advantages [N] or None, scored)`` round ``b`` stores for its kept rows: the filter's, the
    kept-nothing fallback's zeros, times each row's prompt-skip weight (``1 / p x rolled-out / drawn``)."""
    adv, sc = train_adv.get(id(b), (None, None))
    if adv is None and empty:  # the kept-nothing fallback: zero-advantage rows
        adv = torch.zeros(len(b.keys))
    if adv is not None and skip is not None:
        adv = adv.double() * skip.row_weights(uid)
    return adv, sc


def filter_kv_batch(
    batch: KVBatchMeta,
    filt: CompletionFilter,
    options: FilterOptions,
    *,
    store: Any = tq,
    more: Any = None,
    return_groups: bool = False,
    skip: VerlSkipStage | None = None,
) -> Any:
    """Filter one sampled v1 batch; ``more(n_prompts) -> KVBatchMeta | None`` rolls out and samples ``n``
    more prompts (refill); dropped rows are cleared from ``store`` (TransferQueue). Returns ``(kept batch,
    metrics)``, plus with ``return_groups`` the full groups of the kept uids (:func:`_full_groups`). With
    prompt ``skip`` (no refill) every rolled-out group is observed and each kept row's stored advantage is
    multiplied by its prompt's weight."""
    rounds: list[KVBatchMeta] = []
    uids: dict[int, list[Any]] = {}
    scores: list[torch.Tensor] = []

    def produce(n_prompts: int) -> Round[KVBatchMeta] | None:
        b = batch if not rounds else (more(n_prompts) if more is not None else None)
        if b is None or len(b.keys) == 0:
            return None
        rounds.append(b)
        fields = store.kv_batch_get(keys=b.keys, partition_id=b.partition_id, select_fields=list(KV_FIELDS))
        rewards, uid, mask = rewards_from_fields(fields)
        uids[id(b)] = uid
        if skip is not None:
            skip.observe_rows(uid, rewards, mask.sum(-1))
        scored = scored_batch(rewards, uid, mask, options.advantage_config)
        scores.append(scored.rewards.detach().double().cpu())
        return Round(payload=b, scored=scored, num_prompts=len(set(uid)))

    target = options.target_rows or len(batch.keys)
    outcome = _refiller(batch, target, options, more).fill(filt, produce)
    keys: list[str] = []
    tags: list[dict] = []
    kept_by_round = _kept_by_round(outcome, options)
    empty = _keep_something(kept_by_round, rounds, outcome, options)
    train_adv = {id(sel.round.payload): _train_advantages(sel, options) for sel in outcome.selections}
    weighted = [sel for sel in outcome.selections if sel.weights is not None]
    groups: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in rounds:
        adv, sc = _round_advantages(b, train_adv, empty, skip, uids[id(b)])
        kept_rows = _store_kept(b, kept_by_round.get(id(b), set()), adv, store)
        keys += [b.keys[i] for i in kept_rows]
        tags += [b.tags[i] for i in kept_rows]
        if kept_rows and return_groups and sc is not None:
            assert adv is not None
            groups.update(_full_groups(sc, uids[id(b)], kept_rows, adv, bool(weighted)))
    metrics = _filter_metrics(outcome, weighted, len(keys), target, empty, scores)
    if skip is not None:
        metrics.update(skip.step_metrics())
    out = KVBatchMeta(
        partition_id=batch.partition_id, keys=keys, tags=tags, extra_info=dict(batch.extra_info or {})
    )
    return (out, metrics, groups) if return_groups else (out, metrics)


def restore_group_advantages(batch: KVBatchMeta, *, store: Any = tq) -> KVBatchMeta:
    """Overwrite ``advantages``/``returns`` of ``batch`` with the full-group advantages the filter
    stored (verl's ``_compute_advantage`` only sees the kept rows, so it would re-normalise within
    them). Synthetic padding rows copy a real row's field but have an all-zero response mask."""
    data = store.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=[SEQ_ADV_FIELD, "response_mask"]
    )
    seq = data[SEQ_ADV_FIELD].reshape(-1).float()
    mask = data["response_mask"]
    if getattr(mask, "is_nested", False):
        parts = [seq[i] * m.float() for i, m in enumerate(mask.unbind())]
        adv = torch.nested.nested_tensor(parts, layout=torch.jagged)
        ret = torch.nested.nested_tensor([p.clone() for p in parts], layout=torch.jagged)
    else:
        adv = seq[:, None] * mask.float()
        ret = adv.clone()
    fields = TensorDict({"advantages": adv, "returns": ret}, batch_size=[len(batch.keys)])
    store.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
    return batch
