"""OpenRLHF's batch layout <-> grpo_parts' :class:`~grpo_parts.attention.protocol.LogprobBatch`.
OpenRLHF 0.11.2 hands ``Actor.forward`` right-padded ``sequences: [B, T]`` with ``attention_mask``, and
``action_mask: [B, A]`` over the targets of the last ``A`` positions (multi-turn agents interleave
environment tokens, mask 0). A row's *prefix* is every real token before its first action, its
*completion* every real token from there on (environment tokens included, masked out afterwards); rows
with identical prefixes form a group. Pure torch, tested without OpenRLHF."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.errors import GRPOPartsError, check_tensor


@dataclass(frozen=True)
class OpenRLHFLayout:
    """How the rows of a :class:`LogprobBatch` map back to OpenRLHF's ``[B, T]`` tensors: ``rows: [K]``
    the rows with a completion token; ``target_pos: [K, C]`` the index into ``log_probs[:, :-1]`` of
    completion token ``c`` of row ``k``, or the dropped scratch column ``T - 1`` for padding."""

    batch: LogprobBatch
    rows: torch.Tensor
    target_pos: torch.Tensor
    num_rows: int
    seq_len: int


def to_logprob_batch(
    sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, pad_token_id: int = 0
) -> OpenRLHFLayout | None:
    """Split each row into (prefix, completion) at its first action; ``None`` when no row has an action."""
    check_tensor("sequences", sequences, ndim=2, dtype="int")
    b, t = sequences.shape
    check_tensor("attention_mask", attention_mask, shape=[b, t], dtype="bool_or_int")
    check_tensor("action_mask", action_mask, shape=[b, None], dtype="bool_or_int")
    a = action_mask.shape[1]
    if a > t - 1:
        raise GRPOPartsError(f"action_mask: expected at most T - 1 = {t - 1} columns, got {a}")
    am = attention_mask.long()
    runs = (am[:, 0] == 1).long() + (am.diff(dim=1) == 1).long().sum(1)  # number of runs of real tokens
    if bool((runs > 1).any()):
        raise GRPOPartsError(
            "attention_mask: expected each row's real tokens to be contiguous (left or right padding)"
        )
    length = am.sum(1)
    start = am.argmax(1)  # first real token (0 for right padding)
    act = action_mask.bool()
    has_action = act.any(1)
    first_k = act.long().argmax(1)
    first_pos = t - a + first_k  # padded position of the first action token
    last_pos = t - a + (a - 1 - act.long().flip(1).argmax(1))
    outside = (has_action & ((first_pos < start + 1) | (last_pos >= start + length))).nonzero()
    if outside.numel():
        row = int(outside[0])
        raise GRPOPartsError(
            f"action_mask: row {row} marks actions outside its real tokens after the first "
            f"(real tokens at [{int(start[row])}, {int(start[row] + length[row])}), "
            f"actions at [{int(first_pos[row])}, {int(last_pos[row])}])"
        )
    rows = has_action.nonzero().flatten()
    if rows.numel() == 0:
        return None
    dev = sequences.device
    p_len = first_pos[rows] - start[rows]  # prefix length in real tokens
    c_len = length[rows] - p_len
    pw, cw = int(p_len.max()), int(c_len.max())
    col_p = torch.arange(pw, device=dev)[None, :]
    col_c = torch.arange(cw, device=dev)[None, :]
    # prompt, left-padded: column j holds real token (j - (pw - P)) of the prefix
    p_mask = col_p >= (pw - p_len)[:, None]
    p_src = (start[rows, None] + col_p - (pw - p_len)[:, None]).clamp(0, t - 1)
    prompt_ids = torch.where(p_mask, sequences[rows[:, None], p_src], torch.full_like(p_src, pad_token_id))
    # completion, right-padded: column c holds real token P + c
    c_mask = col_c < c_len[:, None]
    c_src = (first_pos[rows, None] + col_c).clamp(0, t - 1)
    completion_ids = torch.where(
        c_mask, sequences[rows[:, None], c_src], torch.full_like(c_src, pad_token_id)
    )
    target = torch.where(c_mask, c_src - 1, torch.full_like(c_src, t - 1))
    group_index = _group_by_prefix(prompt_ids, p_mask)
    batch = LogprobBatch(prompt_ids, p_mask.long(), completion_ids, c_mask.long(), group_index)
    return OpenRLHFLayout(batch, rows, target, b, t)


def _group_by_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[K]`` group ids, numbered by first occurrence: rows with identical prefixes share one."""
    keys: dict[tuple[int, ...], int] = {}
    out = []
    for ids, m in zip(prompt_ids.tolist(), prompt_mask.tolist()):
        key = tuple(i for i, keep in zip(ids, m) if keep)
        out.append(keys.setdefault(key, len(keys)))
    return torch.tensor(out, dtype=torch.long, device=prompt_ids.device)


def scatter_to_openrlhf(values: torch.Tensor, layout: OpenRLHFLayout, num_actions: int) -> torch.Tensor:
    """Place per-completion-token ``values: [K, C]`` at OpenRLHF's positions; returns ``[B, A]``
    (the last ``A`` columns of ``log_probs[:, :-1]``), zeros elsewhere, differentiable."""
    b, t = layout.num_rows, layout.seq_len
    k = layout.rows.numel()
    full = values.new_zeros(k, t).scatter(1, layout.target_pos, values)  # column t - 1: scratch for padding
    out = values.new_zeros(b, t).index_copy(0, layout.rows, full)
    return out[:, : t - 1][:, t - 1 - num_actions :]
