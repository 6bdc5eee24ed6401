"""Shared-prefix log-probs for verl's packed micro-batches, grouped by ``uid``: :func:`packed_call`
unpacks verl's nested ``input_ids`` into one :class:`LogprobBatch`; :func:`run_packed` runs it and rolls
the result into verl's layout (position ``j`` holds ``log p(token j+1 | tokens <= j)``; non-response
positions are 0, masked by verl's ``response_mask``). :mod:`.engine` calls them from ``forward_step``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from grpo_parts.attention.protocol import AttentionBackend, LogprobBatch
from grpo_parts.attention.shared_prefix.packed import unpack
from grpo_parts.build import build_attention
from grpo_parts.doors.vision import image_groups
from grpo_parts.errors import GRPOPartsError, check_tensor
from grpo_parts.types import VisionInputs

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


@dataclass(frozen=True)
class PackedCall:
    """A packed micro-batch as one backend call: ``batch`` holds its sequences with a response (rows
    grouped by ``uid``), ``cells: ([K], [K])`` the batch cell of each completion token in packed
    order and ``where: [K]`` its packed position, of ``nnz``."""

    batch: LogprobBatch
    cells: tuple[torch.Tensor, torch.Tensor]
    where: torch.Tensor
    nnz: int


def packed_call(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    group_keys: Sequence[Any] | None = None,
    images: VisionInputs | None = None,
) -> PackedCall | None:
    """The backend call of a packed micro-batch (``input_ids: [nnz]`` or ``[1, nnz]``, ``cu_seqlens:
    [B + 1]``, ``response_lens: [B]``, ``group_keys``: verl's ``uid`` per sequence, ``images``: each
    sequence's vision inputs, verl's ``multi_modal_inputs``); None when no sequence has a response
    token (nothing to score). Rows share a group when their uid *and* their images are equal."""
    ids, cu, resp, lens = _checked_packing(input_ids, cu_seqlens, response_lens)
    plen = lens - resp
    gi = group_index(ids, cu, plen, group_keys)
    vision = None
    if images is not None:
        if len(images.per_prompt) != plen.numel():
            raise GRPOPartsError(
                f"multi_modal_inputs: expected one entry per sequence ({plen.numel()}), got {len(images.per_prompt)}"
            )
        gi, vision = image_groups(gi, images)
    has = resp > 0
    if not bool(has.any()):
        return None
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=ids.device), lens)
    tok = has[seq]
    sub_cu = torch.cat([cu.new_zeros(1), lens[has].cumsum(0)])
    batch, rows, cols = unpack(ids[tok], sub_cu, plen[has], gi[has])
    batch = replace(batch, vision=vision)
    off = torch.arange(ids.numel(), device=ids.device) - cu[:-1][seq]
    where = (off >= plen[seq]).nonzero().reshape(-1)  # completion tokens, in packed order
    return PackedCall(batch, (rows, cols), where, ids.numel())


def scalar_temperature(temperature: float | torch.Tensor) -> float:
    if isinstance(temperature, torch.Tensor):
        flat = temperature.reshape(-1)
        if flat.numel() == 0 or bool((flat != flat[0]).any()):
            raise GRPOPartsError(f"temperature: expected one value for the micro-batch, got {flat.tolist()}")
        return float(flat[0])
    return float(temperature)


def _checked_packing(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, response_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [nnz], cu [B + 1], resp [B], lens [B])`` on the tokens' device, checked: offsets
    ``0 .. nnz`` non-decreasing, every sequence at least one prompt token long."""
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
    bad = ((lens - resp < 1) | (resp < 0)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise GRPOPartsError(
            f"response_lens[{i}]: expected 0 <= value < sequence length {int(lens[i])} (>= 1 prompt token), "
            f"got {int(resp[i])}"
        )
    return ids, cu, resp, lens


def run_packed(
    model: torch.nn.Module,
    call: PackedCall,
    backend: AttentionBackend,
    temperature: float,
    compute_entropy: bool,
    plan: Any = None,
) -> PackedLogprobs:
    """``call`` through ``backend``: its ``plan`` (:meth:`~grpo_parts.attention.protocol.Plans.plan`,
    agreed across ranks) when given, else its ``completion_logprobs``; the result in verl's rolled
    layout ``[nnz]``. Position i of a sequence holds log p(token i); verl's rolled layout wants it at
    i - 1, and the element rolled in at each sequence's last position is a prompt token's 0."""
    if plan is not None:
        out = backend.run(model, call.batch, plan, temperature, compute_entropy)  # type: ignore[attr-defined]
    else:
        out = backend.completion_logprobs(model, call.batch, temperature, compute_entropy)

    def rolled(x: torch.Tensor) -> torch.Tensor:
        vals = x[call.cells]
        return torch.roll(vals.new_zeros(call.nnz).index_put((call.where,), vals), shifts=-1)

    entropy = rolled(out.entropies) if compute_entropy and out.entropies is not None else None
    return PackedLogprobs(rolled(out.logprobs), entropy)


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
    """Log-probs (and entropies) of every response token of a packed micro-batch in verl's rolled layout
    ``[nnz]``, in one backend call (``input_ids: [nnz]`` or ``[1, nnz]``, ``cu_seqlens: [B + 1]``,
    ``response_lens: [B]``); empty responses get zeros (no response token at all: zeros, no forward)."""
    temp = scalar_temperature(temperature)
    call = packed_call(input_ids, cu_seqlens, response_lens, group_keys)
    if call is None:
        zeros = torch.zeros(input_ids.numel(), device=input_ids.device)
        return PackedLogprobs(zeros, zeros.clone() if compute_entropy else None)
    return run_packed(model, call, build_attention(backend), temp, compute_entropy)
