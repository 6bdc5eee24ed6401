"""*Packed* (padding-free) batches, as verl's remove-padding path feeds them (sequences back to back,
delimited by ``cu_seqlens``), unpacked into a :class:`LogprobBatch` by index maps, no per-token loop."""

from __future__ import annotations

import torch

from ...errors import GRPOPartsError, check_tensor
from ..protocol import LogprobBatch


def unpack(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, prompt_lens: torch.Tensor, group_index: torch.Tensor
) -> tuple[LogprobBatch, torch.Tensor, torch.Tensor]:
    """Packed ``[total]`` tokens -> ``(batch, rows, cols)``: completion token ``(n, t)`` of the batch
    sits at packed position ``cu_seqlens[n] + prompt_lens[n] + t``; ``rows, cols`` list the batch
    cells of every completion token in packed order."""
    ids = input_ids.reshape(-1) if input_ids.ndim == 2 and input_ids.shape[0] == 1 else input_ids
    check_tensor("input_ids", ids, ndim=1, dtype="int")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtype="int")
    n = cu_seqlens.numel() - 1
    check_tensor("prompt_lens", prompt_lens, shape=[n], dtype="int")
    check_tensor("group_index", group_index, shape=[n], dtype="int")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != ids.numel() or bool((cu_seqlens.diff() < 0).any()):
        raise GRPOPartsError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to len(input_ids)={ids.numel()}, "
            f"got {cu_seqlens.tolist()[:8]}..."
        )
    lens = cu_seqlens.diff()
    clens = lens - prompt_lens
    if bool((prompt_lens < 1).any()) or bool((clens < 1).any()):
        r = int(((prompt_lens < 1) | (clens < 1)).nonzero()[0])
        raise GRPOPartsError(
            f"prompt_lens: expected 1 <= prompt_lens[n] < sequence length, sequence {r} has length "
            f"{int(lens[r])} and prompt_lens {int(prompt_lens[r])}"
        )
    p, t = int(prompt_lens.max()), int(clens.max())
    dev = ids.device
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens)  # sequence of each packed token
    off = torch.arange(ids.numel(), device=dev) - cu_seqlens[:-1].long()[seq]  # offset inside it
    is_prompt = off < prompt_lens[seq]
    prompt_ids = torch.zeros(n, p, dtype=ids.dtype, device=dev)
    prompt_mask = torch.zeros(n, p, dtype=torch.long, device=dev)
    pcol = (p - prompt_lens[seq] + off)[is_prompt]  # left-padded
    prompt_ids[seq[is_prompt], pcol] = ids[is_prompt]
    prompt_mask[seq[is_prompt], pcol] = 1
    rows = seq[~is_prompt]
    cols = (off - prompt_lens[seq])[~is_prompt]
    completion_ids = torch.zeros(n, t, dtype=ids.dtype, device=dev)
    completion_mask = torch.zeros(n, t, dtype=torch.long, device=dev)
    completion_ids[rows, cols] = ids[~is_prompt]
    completion_mask[rows, cols] = 1
    batch = LogprobBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, group_index)
    return batch, rows, cols
