"""Shared-prefix layout: regroup a :class:`LogprobBatch` into one row per prompt, and back.

Each group becomes one grid row ``[ prefix (Pp, right-padded) | slot 0 (S) | ... | slot G-1 (S) ]``.
Position ids count real tokens as in the reference; padding carries the reference batch's largest
position id (``max_position``), so RoPE variants that scale by it (dynamic NTK, longrope) see what
the reference sees. The prefix is right-padded so its causal self-attention never sees a pad key.
docs/attention.md, "How it works".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import GRPOPartsError
from ..protocol import LogprobBatch

#: the kwarg that carries the layout through ``model(...)`` to the attention function
LAYOUT_KWARG = "grpo_prefix_layout"


class Receipts:
    """The attention modules that received a layout, in call order. Deliberately not a list: wrappers
    that map over a forward's keyword arguments (FSDP2's input casting, ``_apply_to_tensors``) rebuild
    lists and dataclasses but pass other objects through, so every copy of the layout shares this."""

    def __init__(self) -> None:
        self.modules: list[Any] = []

    def append(self, module: Any) -> None:
        self.modules.append(module)

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Any:
        return iter(self.modules)


@dataclass(frozen=True)
class PrefixLayout:
    """Segment boundaries of the grid (identical for every row), as the attention kernels see them.
    ``prefix_valid: [B, Pp]``: True on real prefix tokens (None: every prompt is ``Pp`` long).
    ``max_span``: the longest real sequence (prompt + completion), checked against sliding windows.
    ``receipts``: the attention modules the kernel ran with this layout; after the forward,
    :func:`.guard.layout_shortfall` requires one in every decoder layer (a layer without the layout
    attended over the whole grid row)."""

    prefix_len: int
    num_slots: int
    slot_len: int
    prefix_valid: torch.Tensor | None
    max_span: int
    kernel: str = "sdpa"
    tile_elems: int = 1 << 24  # cap on one suffix-self score tile (elements) in the sdpa kernel
    suffix_flash_min: int = 512  # sdpa kernel: suffixes at least this long use flash for suffix-self
    receipts: Receipts = field(default_factory=Receipts, compare=False, repr=False)

    @property
    def row_len(self) -> int:
        return self.prefix_len + self.num_slots * self.slot_len


@dataclass(frozen=True)
class GroupedInputs:
    """Model inputs in the grid layout plus the maps needed to un-group its outputs."""

    input_ids: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    layout: Any  # PrefixLayout, or padding_free.PaddingFreeLayout
    keep: torch.Tensor  # [K] grid columns whose logits are needed (``logits_to_keep``)
    row_group: torch.Tensor  # [N] grid row of each batch row
    row_keep: torch.Tensor  # [N, S] index into ``keep`` of the logit predicting completion token t
    completion_len: torch.Tensor  # [N]


def _check_masks(batch: LogprobBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_mask [N, P], completion_mask [N, T])`` as bool, after checking that prompts are
    left-padded and completions right-padded (raises :class:`GRPOPartsError` otherwise)."""
    pm, cm = batch.prompt_mask.bool(), batch.completion_mask.bool()
    bad = (~pm[:, -1]).nonzero()
    if bad.numel():
        raise GRPOPartsError(
            f"LogprobBatch.prompt_mask: expected left-padded prompts (last column real), row {int(bad[0])} "
            "ends in padding"
        )
    gaps = (cm[:, 1:] & ~cm[:, :-1]).any(-1).nonzero()
    if gaps.numel():
        r = int(gaps[0])
        raise GRPOPartsError(
            f"LogprobBatch.completion_mask: expected right-padded completions (1s then 0s), row {r} is "
            f"{cm[r].int().tolist()}"
        )
    clen = cm.sum(-1)
    empty = (clen == 0).nonzero()
    if empty.numel():
        raise GRPOPartsError(
            f"LogprobBatch.completion_mask: expected >= 1 completion token per row, row {int(empty[0])} has 0 "
            "(an empty suffix has no tokens to score; drop the row before calling the backend)"
        )
    return pm, cm


def _check_context(plen_row: torch.Tensor, clen: torch.Tensor, max_positions: int | None) -> None:
    if max_positions is None:
        return
    total = plen_row + clen
    over = (total > max_positions).nonzero()
    if over.numel():
        r = int(over[0])
        raise GRPOPartsError(
            f"LogprobBatch: row {r} has {int(plen_row[r])} prompt + {int(clen[r])} completion tokens = "
            f"{int(total[r])}, expected <= the model's context (max_position_embeddings={max_positions})"
        )


def _compact_prompts(batch: LogprobBatch, pm: torch.Tensor, pp: int, pad_token_id: int) -> torch.Tensor:
    """Each prompt's real tokens in a right-padded ``[N, Pp]`` tensor (the reference ignores masked
    prompt tokens entirely, so dropping them is exact)."""
    n = batch.prompt_ids.shape[0]
    device = batch.prompt_ids.device
    dst = (pm.long().cumsum(-1) - 1).clamp(min=0)
    rows = torch.arange(n, device=device).unsqueeze(-1).expand_as(pm)
    prompts = torch.full((n, pp), pad_token_id, dtype=batch.prompt_ids.dtype, device=device)
    prompts[rows[pm], dst[pm]] = batch.prompt_ids[pm]
    return prompts


def _group_rows(
    batch: LogprobBatch, pm: torch.Tensor, plen_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`Rows`' ``(row_group, order, starts, rep, sizes)``; refuses a group whose rows carry
    different prompts (one prefix per group)."""
    uniq, row_group = torch.unique(batch.group_index, return_inverse=True)
    b = int(uniq.numel())
    order = torch.sort(row_group, stable=True).indices
    sizes = torch.bincount(row_group, minlength=b)
    starts = sizes.cumsum(0) - sizes
    rep = order[starts]
    first = rep[row_group]
    same = (plen_row == plen_row[first]) & ((batch.prompt_ids == batch.prompt_ids[first]) | ~pm).all(-1)
    if not bool(same.all()):
        r = int((~same).nonzero()[0])
        raise GRPOPartsError(
            f"LogprobBatch.group_index: rows {int(first[r])} and {r} share group_index "
            f"{int(batch.group_index[r])} but carry different prompts; expected one prompt per group"
        )
    return row_group, order, starts, rep, sizes


@dataclass(frozen=True)
class Rows:
    """What both layouts build on, from :func:`checked_rows`: the masks as bool (``pm: [N, P]``,
    ``cm: [N, T]``), real prompt and completion tokens per row (``plen_row``, ``clen: [N]``), each
    row's group (``row_group``, ascending ``group_index``), the rows in group order (``order``,
    stable: slots in order of appearance), where each group starts in that order (``starts``), its
    first row (``rep``, whose prompt is the group's prefix) and its size (``sizes``)."""

    pm: torch.Tensor
    cm: torch.Tensor
    plen_row: torch.Tensor
    clen: torch.Tensor
    row_group: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor
    rep: torch.Tensor
    sizes: torch.Tensor


def checked_rows(batch: LogprobBatch, max_positions: int | None) -> Rows:
    """``batch``'s :class:`Rows`, after checking its padding, that every row fits the model's
    context ``max_positions`` (None: no limit) and that a group's rows carry one prompt."""
    pm, cm = _check_masks(batch)
    plen_row, clen = pm.sum(-1), cm.sum(-1)
    _check_context(plen_row, clen, max_positions)
    return Rows(pm, cm, plen_row, clen, *_group_rows(batch, pm, plen_row))


def _kept_columns(
    plen: torch.Tensor, row_group: torch.Tensor, row_slot: torch.Tensor, pw: int, g: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, row_keep)``: the grid columns whose logits are needed -- the last real prefix token
    of each distinct prompt length, then positions 0..S-2 of every slot (the last suffix token
    predicts nothing) -- and, per batch row and completion token, its index into ``keep``."""
    device = plen.device
    n = row_group.shape[0]
    ar = torch.arange(s - 1, device=device)
    last, last_inv = torch.unique(plen - 1, return_inverse=True)
    k0 = int(last.numel())
    slot_cols = (pw + torch.arange(g, device=device).unsqueeze(-1) * s + ar).reshape(-1)
    keep = torch.cat([last, slot_cols])
    row_keep = torch.empty(n, s, dtype=torch.long, device=device)
    row_keep[:, 0] = last_inv[row_group]
    row_keep[:, 1:] = k0 + row_slot.unsqueeze(-1) * (s - 1) + ar
    return keep, row_keep


@dataclass(frozen=True)
class LayoutSettings:
    """What building a layout reads of the backend's settings (:attr:`.plan.PlanSettings.build`):
    ``max_positions`` is the model's context (None: none), ``pad_token_id`` fills empty slots."""

    kernel: str = "sdpa"
    max_positions: int | None = None
    pad_token_id: int = 0
    tile_elems: int = 1 << 24
    suffix_flash_min: int = 512
    varlen: bool = True


def build_grouped_inputs(
    batch: LogprobBatch, settings: LayoutSettings | None = None, max_position: int | None = None
) -> GroupedInputs:
    """Regroup ``batch`` (rows in any order) into the grid layout; see the module docstring.
    ``max_position``: the largest position id of the reference's forward (the batch this one was
    split from); default: this batch's."""
    settings = settings or LayoutSettings()
    pad_token_id, kernel = settings.pad_token_id, settings.kernel
    r = checked_rows(batch, settings.max_positions)
    pm, cm, plen_row, clen = r.pm, r.cm, r.plen_row, r.clen
    row_group, order, starts, rep, sizes = r.row_group, r.order, r.starts, r.rep, r.sizes
    device = batch.prompt_ids.device
    n = batch.prompt_ids.shape[0]
    pp = int(plen_row.max())
    prompts = _compact_prompts(batch, pm, pp, pad_token_id)
    row_slot = torch.empty_like(row_group)
    row_slot[order] = torch.arange(n, device=device) - starts[row_group[order]]
    b = int(sizes.numel())
    g, s = int(sizes.max()), int(clen.max())
    plen = plen_row[rep]  # [B]
    top = int((plen_row + clen).max()) - 1  # this batch's largest position id
    max_position = top if max_position is None else max_position
    # a grid with no padding token at all whose rows end below max_position: one more prefix column
    pw = pp + int(top < max_position and b * (pp + g * s) == int(plen.sum() + clen.sum()))

    ids = torch.full((b, pw + g * s), pad_token_id, dtype=batch.prompt_ids.dtype, device=device)
    ids[:, :pp] = prompts[rep]
    ar_s = torch.arange(s, device=device)
    cols = pw + row_slot.unsqueeze(-1) * s + ar_s  # [N, S] grid column of completion token t
    rows_s = row_group.unsqueeze(-1).expand(n, s)
    ids[rows_s, cols] = batch.completion_ids[:, :s]
    pos = torch.cat(
        [torch.arange(pw, device=device).expand(b, pw), (plen.unsqueeze(-1) + ar_s).repeat(1, g)], dim=1
    )
    real = torch.zeros_like(pos, dtype=torch.bool)
    real[:, :pw] = torch.arange(pw, device=device) < plen.unsqueeze(-1)
    real[rows_s, cols] = cm[:, :s]
    pos = pos.masked_fill(~real, max_position)

    keep, row_keep = _kept_columns(plen, row_group, row_slot, pw, g, s)
    valid = None if bool((plen == pw).all()) else real[:, :pw]
    layout = PrefixLayout(pw, g, s, valid, top + 1, kernel, settings.tile_elems, settings.suffix_flash_min)
    return GroupedInputs(ids, pos, layout, keep, row_group, row_keep, clen)


def build_grids(
    batches: list[LogprobBatch], settings: LayoutSettings, max_position: int | None
) -> list[GroupedInputs]:
    """:func:`build_grouped_inputs` of each model call's rows, one grid each (what a plan's run
    builds before its forwards: inputs only, no logits)."""
    return [build_grouped_inputs(b, settings, max_position) for b in batches]
