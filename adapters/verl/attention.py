"""Shared-prefix log-probs for verl's packed micro-batches, grouped by ``uid``.

verl's FSDP engine receives a micro-batch as nested tensors: ``input_ids`` holds every sequence
``[prompt | response]`` back to back (``cu_seqlens = input_ids.offsets()``), and its forward returns
per-token log-probs in a *rolled* layout: position ``j`` of a sequence holds
``log p(token j+1 | tokens <= j)``. :func:`packed_logprobs` hands the packed tokens to
:func:`grpo_parts.attention.packed.packed_completion_logprobs` with ``group_index`` from ``uid``
(any grpo_parts ``AttentionBackend``; ``shared_prefix`` encodes each prompt once per group) and
rolls the result into verl's layout. Positions that do not predict a response token (the prompt,
the last token) are 0: verl's losses and metrics mask them with ``response_mask``.

The engine hook that calls this from verl's ``forward_step`` is :mod:`.engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_parts.attention import get_attention_class
from grpo_parts.attention.packed import packed_completion_logprobs
from grpo_parts.attention.protocol import AttentionBackend
from grpo_parts.errors import GRPOPartsError, check_tensor

from .advantage import uid_to_group_index


@dataclass(frozen=True)
class PackedLogprobs:
    """``log_probs: [nnz]`` and ``entropy: [nnz]`` (or None) in verl's rolled packed layout."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


def group_index(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, prompt_lens: torch.Tensor, keys: Sequence[Any] | None
) -> torch.Tensor:
    """``[B]`` group of each sequence: by ``keys`` (verl's ``uid``), or by identical prompt tokens
    when no keys are given. Rows of one uid must carry the same prompt (sharing is exact only for
    identical prefixes)."""
    cu, plen = cu_seqlens.tolist(), prompt_lens.tolist()
    prompts = [tuple(input_ids[cu[i] : cu[i] + plen[i]].tolist()) for i in range(len(plen))]
    keys = list(keys) if keys is not None else prompts
    if len(keys) != len(prompts):
        raise GRPOPartsError(f"uid: expected {len(prompts)} entries (one per sequence), got {len(keys)}")
    gi, _ = uid_to_group_index(keys)
    first: dict[int, int] = {}
    for row, g in enumerate(gi.tolist()):
        j = first.setdefault(g, row)
        if prompts[j] != prompts[row]:
            raise GRPOPartsError(
                f"uid: rows {j} and {row} share uid {keys[row]!r} but their prompts differ "
                f"(lengths {len(prompts[j])} and {len(prompts[row])})"
            )
    return gi.to(input_ids.device)


def grid_tokens(
    backend: str, prompt_lens: torch.Tensor, response_lens: torch.Tensor, gi: torch.Tensor
) -> int:
    """Tokens the backend runs the model on: ``shared_prefix`` lays each group out as
    ``[prefix | slot x G]`` padded to the longest prompt, completion and group of the micro-batch
    (grpo_parts/attention/layout.py); ``reference`` pads ``[prompt | completion]`` rows."""
    if prompt_lens.numel() == 0:
        return 0
    p, s = int(prompt_lens.max()), int(response_lens.max())
    if backend == "shared_prefix":
        sizes = torch.bincount(gi)
        sizes = sizes[sizes > 0]
        return int(sizes.numel()) * (p + int(sizes.max()) * s)
    return int(prompt_lens.numel()) * (p + s)


def resolve_backend(backend: str | AttentionBackend) -> AttentionBackend:
    return get_attention_class(backend)() if isinstance(backend, str) else backend


def _scalar_temperature(temperature: float | torch.Tensor) -> float:
    if isinstance(temperature, torch.Tensor):
        flat = temperature.reshape(-1)
        if flat.numel() == 0 or bool((flat != flat[0]).any()):
            raise GRPOPartsError(f"temperature: expected one value for the micro-batch, got {flat.tolist()}")
        return float(flat[0])
    return float(temperature)


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    group_keys: Sequence[Any] | None = None,
    temperature: float | torch.Tensor = 1.0,
    backend: str | AttentionBackend = "shared_prefix",
    compute_entropy: bool = False,
) -> PackedLogprobs:
    """Log-probs (and entropies) of every response token of a packed micro-batch, in verl's rolled
    layout ``[nnz]``. ``input_ids: [nnz]`` (or ``[1, nnz]``), ``cu_seqlens: [B + 1]``,
    ``response_lens: [B]``; sequences with an empty response contribute zeros."""
    temp = _scalar_temperature(temperature)
    ids = input_ids.reshape(-1)
    check_tensor("input_ids", ids, ndim=1, dtype="int")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtype="int")
    b = cu_seqlens.numel() - 1
    check_tensor("response_lens", response_lens, shape=[b], dtype="int")
    cu = cu_seqlens.to(ids.device).long()
    resp = response_lens.to(ids.device).long()
    lens = cu.diff()
    if int(cu[0]) != 0 or int(cu[-1]) != ids.numel() or bool((lens < 0).any()):
        raise GRPOPartsError(f"cu_seqlens: expected 0 .. {ids.numel()} non-decreasing, got {cu.tolist()}")
    plen = lens - resp
    bad = ((plen < 1) | (resp < 0)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise GRPOPartsError(
            f"response_lens[{i}]: expected 0 <= value < sequence length {int(lens[i])} (>= 1 prompt token), "
            f"got {int(resp[i])}"
        )
    gi = group_index(ids, cu, plen, group_keys)
    nnz = ids.numel()
    keep = resp > 0
    if not bool(keep.any()):
        zeros = torch.zeros(nnz, device=ids.device)
        return PackedLogprobs(zeros, zeros.clone() if compute_entropy else None)
    # sequences with an empty response have nothing to score: leave them out
    token_kept = keep[torch.repeat_interleave(torch.arange(b, device=ids.device), lens)]
    sub_cu = torch.cat([cu.new_zeros(1), lens[keep].cumsum(0)])
    out = packed_completion_logprobs(
        model,
        ids[token_kept],
        sub_cu,
        plen[keep],
        gi[keep],
        backend=resolve_backend(backend),
        temperature=temp,
        compute_entropy=compute_entropy,
    )

    def roll(x: torch.Tensor) -> torch.Tensor:
        # position i of a sequence holds log p(token i); verl's rolled layout wants it at i - 1. The
        # element rolled in at each sequence's last position is a prompt token's 0.
        if x.numel() != nnz:
            x = x.new_zeros(nnz).masked_scatter(token_kept, x)
        return torch.roll(x, shifts=-1)

    return PackedLogprobs(roll(out.logprobs), None if out.entropies is None else roll(out.entropies))
