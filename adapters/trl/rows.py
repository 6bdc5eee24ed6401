"""Row bookkeeping between TRL's batches and grpo_parts' types (no TRL import, no maths): recover
TRL's prompt runs and groups, run a backend on TRL's rows regrouped by prompt, round and stack kept
batches, and re-cut micro-batches with each prompt's rows together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from grpo_parts.attention.protocol import AttentionBackend, LogprobBatch, RankAgreeing
from grpo_parts.attention.shared_prefix.chunking import empty_call_batch
from grpo_parts.distributed import agree_on_calls
from grpo_parts.doors.vision import image_groups, same_images
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.apply import select_rows
from grpo_parts.filter.rounding import round_to_multiple
from grpo_parts.types import VISION_KEYS, ScoredBatch, VisionInputs


def prompt_runs(
    prompt_ids: Sequence[Sequence[int]], group_size: int, images: VisionInputs | None = None
) -> tuple[list[list[int]], int]:
    """``(unique_prompts, group_size)`` when the rows are runs of ``group_size`` identical prompts
    (TRL's order; with ``images``, one per row, identical images too), else ``(rows, 1)`` (every row
    its own group: still correct, just no sharing)."""
    rows = [list(p) for p in prompt_ids]
    g = group_size

    def same(i: int, j: int) -> bool:
        return rows[i] == rows[j] and (
            images is None or same_images(images.per_prompt[i], images.per_prompt[j])
        )

    if g > 1 and len(rows) % g == 0 and all(same(i, i - i % g) for i in range(len(rows))):
        return [rows[i] for i in range(0, len(rows), g)], g
    return rows, 1


def group_by_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``group_index: [N]``: rows with the same real prompt tokens (and padding) share a group. Two dataset
    rows with the same prompt land in the same group; that is harmless (and cheaper): a shared-prefix
    backend only needs rows of a group to carry the same prompt."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    return torch.unique(key, dim=0, return_inverse=True)[1].to(torch.long)


def _group_chunks(group: torch.Tensor, batch_size: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(order, chunks)``: the rows sorted by group (stable), cut into chunks of whole groups of
    about ``batch_size`` rows (all rows when None); a group is never split."""
    n = group.shape[0]
    order = torch.sort(group, stable=True).indices
    chunks: list[torch.Tensor] = []
    limit = batch_size or n
    start = 0
    sorted_group = group[order].tolist()
    while start < n:
        end = min(start + limit, n)
        while end < n and sorted_group[end] == sorted_group[end - 1]:
            end += 1  # never split a group
        chunks.append(order[start:end])
        start = end
    return order, chunks


def _call_chunks(
    backend: AttentionBackend,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    p: int,
    group: torch.Tensor,
    chunks: list[torch.Tensor],
    temperature: float,
    compute_entropy: bool,
    vision: VisionInputs | None,
) -> tuple[list[torch.Tensor], list[Any], LogprobBatch | None]:
    """One backend call per chunk of rows (``p``: prompt columns): the log-probs and entropies of
    each call, and the last call's batch (what empty calls are shaped after, :func:`_with_empty_calls`;
    None without chunks)."""
    out_logps, out_ents = [], []
    batch = None
    for rows in chunks:
        ids, mask = input_ids[rows], attention_mask[rows]
        batch = LogprobBatch(ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:], group[rows], vision)
        res = backend.completion_logprobs(
            model, batch, temperature=temperature, compute_entropy=compute_entropy
        )
        out_logps.append(res.logprobs)
        out_ents.append(res.entropies)
    return out_logps, out_ents, batch


def _with_empty_calls(
    logps: torch.Tensor,
    backend: AttentionBackend,
    model: torch.nn.Module,
    batch: LogprobBatch | None,
    temperature: float,
    extra: int,
) -> torch.Tensor:
    """``logps`` plus ``extra`` empty backend calls, in the graph times zero (their backward runs
    too), so this rank makes as many calls as the others (:func:`_extra_calls`)."""
    if not extra:
        return logps
    assert batch is not None  # a batch of >= 1 row makes >= 1 call
    empty = empty_call_batch(batch)
    return logps + sum(
        backend.completion_logprobs(model, empty, temperature=temperature).logprobs.sum() * 0.0
        for _ in range(extra)
    )


def regrouped_logprobs(
    backend: AttentionBackend,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float,
    compute_entropy: bool,
    batch_size: int | None = None,
    images: VisionInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's ``_get_per_token_logps_and_entropies`` contract through a grpo_parts backend, on rows sorted
    by group in chunks of whole groups of about ``batch_size`` rows (TRL's memory bound); ``images``: each
    row's images, or None (rows share a group when their prompt tokens and images are equal). Fully masked
    rows (``mask_truncated_completions``) skip the backend and get 0, as TRL's forward returns; a batch with
    no row left gives zeros without a graph, so under grad, and with several processes on every rank, the
    caller must run TRL's own forward instead. Every rank makes as many backend calls as the rank that
    makes the most (:func:`_extra_calls`)."""
    n, width = input_ids.shape
    p = width - logits_to_keep
    if p < 1:
        raise GRPOPartsError(
            f"logits_to_keep: expected < input width {width} (a prompt is needed), got {logits_to_keep}"
        )
    live = attention_mask[:, p:].bool().any(-1)
    if not bool(live.all()):  # the live rows only, zeros at every position of the others
        if not bool(live.any()):
            zeros = torch.zeros(n, logits_to_keep, device=input_ids.device)
            return zeros, (zeros.clone() if compute_entropy else None)
        idx = live.nonzero().flatten()
        ids, mask = input_ids[idx], attention_mask[idx]
        sub = None if images is None else VisionInputs(tuple(images.per_prompt[i] for i in idx.tolist()))
        lp, ent = regrouped_logprobs(
            backend, model, ids, mask, logits_to_keep, temperature, compute_entropy, batch_size, sub
        )
        lp = lp.new_zeros(n, logits_to_keep).index_copy(0, idx, lp)
        return lp, (None if ent is None else ent.new_zeros(n, logits_to_keep).index_copy(0, idx, ent))
    group = group_by_prompt(input_ids[:, :p], attention_mask[:, :p])
    vision = None
    if images is not None:
        group, vision = image_groups(group, images)
    order, chunks = _group_chunks(group, batch_size)
    extra = _extra_calls(backend, len(chunks), input_ids.device)  # before any call: collectives
    out_logps, out_ents, batch = _call_chunks(
        backend, model, input_ids, attention_mask, p, group, chunks, temperature, compute_entropy, vision
    )
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n, device=order.device)
    logps = _with_empty_calls(torch.cat(out_logps, dim=0)[inv], backend, model, batch, temperature, extra)
    if not compute_entropy:
        return logps, None
    if any(e is None for e in out_ents):
        raise GRPOPartsError(
            f"{type(backend).__name__}.completion_logprobs: compute_entropy=True but got no entropies"
        )
    return logps, torch.cat([e for e in out_ents if e is not None], dim=0)[inv]


def _extra_calls(backend: Any, calls: int, device: torch.device) -> int:
    """With several processes, how many empty backend calls this rank adds to its ``calls`` to make
    as many as the rank that makes the most (one all-reduce; 0 on one process). Every call runs
    collectives (ZeRO-3 / FSDP gather parameters in each forward, the backends agree on their plans),
    and a rank's chunk count depends on how its groups fall: TRL deals rows, not groups, to the ranks."""
    group = backend.rank_group if isinstance(backend, RankAgreeing) else None
    return agree_on_calls(calls, group, device) - calls


def round_kept(
    scored: Sequence[ScoredBatch],
    kept: Sequence[torch.Tensor],
    multiple: int,
    mode: Literal["up", "down"],
    last: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """:func:`grpo_parts.filter.rounding.round_to_multiple` for ``steps_per_generation``."""
    return round_to_multiple(scored, kept, multiple, mode, last, field="steps_per_generation")


def drop_no_loss_rows(kept: Sequence[torch.Tensor], no_loss: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Rows with no loss token are never kept ahead of rows that carry loss tokens: when any row
    with loss tokens was pruned (in any round), drop the kept rows flagged in ``no_loss``."""
    pruned_live = any(int((~d).sum()) > int((~d[k]).sum()) for k, d in zip(kept, no_loss))
    if not pruned_live:
        return list(kept)
    return [k[~d[k]] for k, d in zip(kept, no_loss)]


#: TRL batch keys and how to pad them when batches of different widths are stacked
_LEFT: dict[str, str | int | float] = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT: dict[str, str | int | float] = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
    "advantages": 0.0,  # only when a subclass gives per-token [N, T] advantages
}


def concat_batches(batches: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Stack TRL batch dicts row-wise: prompts re-left-padded, completion-width tensors re-right-padded,
    ``[N]`` tensors and lists concatenated. 0-d tensors (``num_items_in_batch``) are dropped: the
    caller recomputes them for the stacked batch."""
    if len(batches) == 1:
        return dict(batches[0])
    keys = list(batches[0])
    for b in batches[1:]:
        if list(b) != keys:
            raise GRPOPartsError(f"refill batches: expected the same keys {keys}, got {list(b)}")
    out: dict[str, Any] = {}
    for key in keys:
        vals = [b[key] for b in batches]
        if key in VISION_KEYS:  # flat over each batch's images: the images of all, in row order
            out[key] = _flat_images(vals)
        elif key in TOKEN_TYPE_KEYS and vals[0] is not None:
            out[key] = _concat_token_types(vals, [b["prompt_ids"].shape[1] for b in batches])
        elif vals[0] is None:
            out[key] = None
        elif isinstance(vals[0], list):
            out[key] = [x for v in vals for x in v]
        elif isinstance(vals[0], torch.Tensor) and vals[0].ndim == 0:
            continue
        elif isinstance(vals[0], torch.Tensor) and vals[0].ndim == 1:
            out[key] = torch.cat(vals)
        elif isinstance(vals[0], torch.Tensor) and (key in _LEFT or key in _RIGHT):
            left = key in _LEFT
            spec = (_LEFT if left else _RIGHT)[key]
            fill = float(pad_token_id if spec == "pad" else spec)  # type: ignore[arg-type]
            width = max(v.shape[1] for v in vals)
            padded = []
            for v in vals:
                d = width - v.shape[1]  # per-sequence [N, 1] values all have width 1: d = 0
                padded.append(torch.nn.functional.pad(v, (d, 0) if left else (0, d), value=fill))
            out[key] = torch.cat(padded)
        else:
            raise GRPOPartsError(
                f"refill: cannot stack batch key {key!r} of type {type(vals[0]).__name__}; "
                "refill supports text-only batches (set refill_rounds=0)"
            )
    return out


def _flat_images(vals: Sequence[Any]) -> torch.Tensor | None:
    """Batches' flat image entries (``pixel_values``, a grid per image) stacked in row order; None
    when no batch has images."""
    given = [v for v in vals if v is not None]
    return torch.cat(given) if given else None


#: TRL's per-token image flags over prompt and completion (``[N, P + C]``, 0 on completions)
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")


def _concat_token_types(vals: Sequence[torch.Tensor], prompt_widths: Sequence[int]) -> torch.Tensor:
    """Stack ``[N_i, P_i + C_i]`` token flags: the prompt part re-left-padded, the completion part
    re-right-padded, with 0 (text)."""
    p = max(prompt_widths)
    c = max(v.shape[1] - w for v, w in zip(vals, prompt_widths))
    F = torch.nn.functional
    return torch.cat(
        [
            torch.cat([F.pad(v[:, :w], (p - w, 0)), F.pad(v[:, w:], (0, c - (v.shape[1] - w)))], dim=1)
            for v, w in zip(vals, prompt_widths)
        ]
    )


def regroup_microbatches(
    chunks: Sequence[dict[str, Any]], generator: torch.Generator
) -> list[dict[str, Any]]:
    """Re-cut TRL's shuffled, equally split micro-batches so that each prompt's rows are adjacent: the
    chunks are stacked back, groups (rows with the same prompt) put in a random order drawn from
    ``generator`` (rows inside a group keep their order) and split into as many equal chunks again. Every
    per-row entry moves with its row; 0-d tensors and ``None`` are kept."""
    size = int(chunks[0]["completion_ids"].shape[0])
    batch: dict[str, Any] = {}
    for key in chunks[0]:
        vals = [c[key] for c in chunks]
        v0 = vals[0]
        if key in VISION_KEYS:  # flat over each chunk's images: each row's stay with it (select_rows)
            batch[key] = _flat_images(vals)
        elif v0 is None or (isinstance(v0, torch.Tensor) and v0.ndim == 0):
            batch[key] = v0
        elif isinstance(v0, torch.Tensor) and v0.shape[0] == size:
            batch[key] = torch.cat(vals)
        elif isinstance(v0, list) and len(v0) == size:
            batch[key] = [x for v in vals for x in v]
        else:
            raise GRPOPartsError(
                f"group_rows: batch key {key!r} is not one entry per row (got {type(v0).__name__}); "
                "set TRLPartsOptions(group_rows=False)"
            )
    group = group_by_prompt(batch["prompt_ids"], batch["prompt_mask"])
    num_groups = int(group.max()) + 1
    rank = torch.empty(num_groups, dtype=torch.long)
    rank[torch.randperm(num_groups, generator=generator)] = torch.arange(num_groups)
    order = torch.sort(rank[group.cpu()], stable=True).indices
    total = size * len(chunks)
    return [select_rows(batch, order[i * size : (i + 1) * size], total) for i in range(len(chunks))]
