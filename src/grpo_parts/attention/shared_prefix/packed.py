"""Shared-prefix log-probs for *packed* (padding-free) batches, as verl's remove-padding path and
OpenRLHF's ``--ds.packing_samples`` feed them (sequences back to back, delimited by ``cu_seqlens``).

:func:`packed_completion_logprobs` unpacks into a :class:`LogprobBatch` (index maps, no per-token
loop), runs any ``AttentionBackend`` and packs the result back.
"""

from __future__ import annotations

import torch

from ...errors import GRPOPartsError, check_tensor
from ..protocol import AttentionBackend, LogprobBatch, LogprobOutput


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


def packed_completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_lens: torch.Tensor,
    group_index: torch.Tensor,
    *,
    backend: AttentionBackend | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> LogprobOutput:
    """Per-token log-probs of a packed batch: ``logprobs: [total]`` where position ``i`` holds
    ``log p(token_i | earlier tokens of its sequence)`` for completion tokens and 0 for prompt
    tokens (verl's rolled convention is ``out[i + 1]`` at ``i``; shift in the adapter).

    ``cu_seqlens: [N+1]`` sequence offsets, ``prompt_lens: [N]`` prompt length of each sequence,
    ``group_index: [N]`` the prompt each sequence belongs to. ``backend`` defaults to
    :class:`~grpo_parts.attention.shared_prefix.backend.SharedPrefixAttention` (``kernel="auto"``)."""
    if backend is None:
        from .backend import SharedPrefixAttention

        backend = SharedPrefixAttention()
    batch, rows, cols = unpack(input_ids, cu_seqlens, prompt_lens, group_index)
    out = backend.completion_logprobs(model, batch, temperature=temperature, compute_entropy=compute_entropy)
    total = input_ids.numel()
    lens = cu_seqlens.diff()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=input_ids.device), lens)
    off = torch.arange(total, device=input_ids.device) - cu_seqlens[:-1].long()[seq]
    is_completion = off >= prompt_lens[seq]

    def pack(x: torch.Tensor) -> torch.Tensor:
        flat = x.new_zeros(total)
        return flat.masked_scatter(is_completion, x[rows, cols])

    return LogprobOutput(pack(out.logprobs), None if out.entropies is None else pack(out.entropies))
