"""Shared-prefix log-probs for verl's packed micro-batches, grouped by ``uid``.

verl's FSDP engine receives a micro-batch as nested tensors: ``input_ids`` holds every sequence
``[prompt | response]`` back to back (``cu_seqlens = input_ids.offsets()``), and its forward returns
per-token log-probs in a *rolled* layout: position ``j`` of a sequence holds
``log p(token j+1 | tokens <= j)``. :func:`packed_logprobs` hands the packed tokens to
:func:`grpo_parts.attention.shared_prefix.packed.packed_completion_logprobs` with ``group_index`` from ``uid``
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

from grpo_parts.attention.protocol import AttentionBackend, LogprobBatch
from grpo_parts.attention.shared_prefix.packed import packed_completion_logprobs, unpack
from grpo_parts.build import build_attention
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
    """Tokens one backend call runs the model on: ``shared_prefix`` lays each group out as
    ``[prefix | slot x G]`` padded to the longest prompt, completion and group of the call
    (grpo_parts/attention/shared_prefix/layout.py); ``reference`` pads ``[prompt | completion]`` rows."""
    if prompt_lens.numel() == 0:
        return 0
    p, s = int(prompt_lens.max()), int(response_lens.max())
    if backend == "shared_prefix":
        sizes = torch.bincount(gi)
        sizes = sizes[sizes > 0]
        return int(sizes.numel()) * (p + int(sizes.max()) * s)
    return int(prompt_lens.numel()) * (p + s)


@dataclass(frozen=True)
class CallPlan:
    """How a packed micro-batch is computed: ``group_index [B]`` (``uid`` groups, split by completion
    length for ``shared_prefix``), ``prompt_lens [B]``, the rows of each backend call (sequences with
    a response only), the tokens all calls run the model on, and the tokens of a padding-free shared
    layout (each ``uid`` prompt once plus every completion: what verl's own Prefix Grouper runs)."""

    group_index: torch.Tensor
    prompt_lens: torch.Tensor
    calls: list[torch.Tensor]
    grid_tokens: int
    padding_free_tokens: int = 0
    #: "padding_free": one call of the ``uid`` groups, for the backend's padding-free layout
    layout: str = "grid"


def _merge(groups: list[torch.Tensor], cost: Any, slack: float) -> list[torch.Tensor]:
    """Consecutive ``groups`` share a call while its layout stays within ``1 + slack`` times the sum
    of their own layouts."""
    calls, cur, own = [], groups[0], cost(groups[0])
    for g in groups[1:]:
        g_own, cand = cost(g), torch.cat([cur, g])
        if cost(cand) <= (1 + slack) * (own + g_own):
            cur, own = cand, own + g_own
        else:
            calls.append(cur)
            cur, own = g, g_own
    calls.append(cur)
    return calls


def plan_calls(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    group_keys: Sequence[Any] | None = None,
    backend: str = "shared_prefix",
    merge_slack: float | None = None,
    layout: str = "grid",
) -> CallPlan:
    """Split a packed micro-batch into backend calls. For ``shared_prefix``, each ``uid`` group is
    first cut into sub-groups of similar completion length whose layouts hold no more tokens than
    their packed rows (:func:`grpo_parts.attention.shared_prefix.chunking.split_long_tails`). One call pads every
    (sub-)group to the call's longest prompt, completion and group; with ``merge_slack`` groups are
    taken longest completion first and a group joins the current call only while the call's layout
    stays within ``1 + merge_slack`` times the sum of its groups' own layouts (0: one call per
    group). **Bound**: when the calls would run more tokens than the packed micro-batch, every
    sub-group gets its own call, which runs at most the packed tokens. ``layout``: the backend's
    (``grid``, ``padding_free`` or ``auto``); unless ``grid``, when the padding-free layout of the
    ``uid`` groups runs fewer tokens than those calls, the micro-batch is one call of the ``uid``
    groups (the backend then lays it out padding-free: each prompt once plus every response token,
    never more than the packed micro-batch); ``CallPlan.layout`` is then ``padding_free`` (the verl
    engine hook re-plans with ``grid`` where the backend's cost choice, ``layout_for``, disagrees)."""
    from grpo_parts.attention.shared_prefix.chunking import split_long_tails

    ids = input_ids.reshape(-1)
    cu, resp = cu_seqlens.to(ids.device).long(), response_lens.to(ids.device).long()
    plen = cu.diff() - resp
    uid_gi = group_index(ids, cu, plen, group_keys)
    rows = (resp > 0).nonzero().reshape(-1)
    if rows.numel() == 0:
        return CallPlan(uid_gi, plen, [], 0)
    free = int(sum(int(plen[rows[uid_gi[rows] == g][0]]) for g in torch.unique(uid_gi[rows]).tolist()))
    free += int(resp.sum())
    shared = backend == "shared_prefix"
    gi = split_long_tails(uid_gi, plen, resp) if shared else uid_gi

    def cost(r: torch.Tensor) -> int:
        return grid_tokens(backend, plen[r], resp[r], gi[r])

    groups = [rows[gi[rows] == g] for g in torch.unique(gi[rows]).tolist()]
    groups.sort(key=lambda r: (-int(resp[r].max()), -int(plen[r[0]])))
    if merge_slack is None or not shared:
        calls = [rows]
    else:
        calls = _merge(groups, cost, merge_slack)
    total = sum(cost(c) for c in calls)
    packed = int((plen[rows] + resp[rows]).sum())
    if shared and total > packed and len(calls) < len(groups):
        calls = groups  # each sub-group's layout <= its packed rows
        total = sum(cost(c) for c in calls)
    if shared and layout != "grid" and (free < total or layout == "padding_free"):
        return CallPlan(uid_gi, plen, [rows], free, free, "padding_free")
    return CallPlan(gi, plen, calls, total, free)


def call_batch(ids: torch.Tensor, cu: torch.Tensor, plan: CallPlan, rows: torch.Tensor) -> LogprobBatch:
    """The :class:`LogprobBatch` the backend gets for the call of ``rows`` (as :func:`packed_logprobs` builds it)."""
    b, lens = cu.numel() - 1, cu.diff()
    in_call = torch.zeros(b, dtype=torch.bool, device=ids.device)
    in_call[rows] = True
    tok = in_call[torch.repeat_interleave(torch.arange(b, device=ids.device), lens)]
    sub_cu = torch.cat([cu.new_zeros(1), lens[in_call].cumsum(0)])
    return unpack(ids[tok], sub_cu, plan.prompt_lens[in_call], plan.group_index[in_call])[0]


def resolve_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """A backend by name (built by :func:`grpo_parts.build.build_attention`), or the instance as is."""
    return build_attention(backend)


def _scalar_temperature(temperature: float | torch.Tensor) -> float:
    if isinstance(temperature, torch.Tensor):
        flat = temperature.reshape(-1)
        if flat.numel() == 0 or bool((flat != flat[0]).any()):
            raise GRPOPartsError(f"temperature: expected one value for the micro-batch, got {flat.tolist()}")
        return float(flat[0])
    return float(temperature)


def _empty_call(
    model: torch.nn.Module, ids: torch.Tensor, cu: torch.Tensor, resp: torch.Tensor, backend: AttentionBackend
) -> torch.Tensor:
    """A backend call on two real tokens of the micro-batch (its first token as a one-token prompt,
    the first response token, or the first token again, as the completion), times zero: it runs the
    model -- and, with grad, its backward -- so that this rank makes as many model calls as the other
    data-parallel ranks (FSDP gathers parameters in every forward), and adds nothing."""
    with_resp = (resp > 0).nonzero().reshape(-1)
    second = (
        ids[int(cu[with_resp[0]]) + int(cu.diff()[with_resp[0]] - resp[with_resp[0]])]
        if with_resp.numel()
        else ids[0]
    )
    pair = torch.stack([ids[0], second])
    out = packed_completion_logprobs(
        model, pair, cu.new_tensor([0, 2]), cu.new_tensor([1]), cu.new_zeros(1), backend=backend
    )
    return out.logprobs.sum() * 0.0


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


def _run_calls(
    model: torch.nn.Module,
    ids: torch.Tensor,
    cu: torch.Tensor,
    lens: torch.Tensor,
    plan: CallPlan,
    impl: AttentionBackend,
    temp: float,
    compute_entropy: bool,
) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
    """One backend call per ``plan.calls`` entry (sequences with an empty response have nothing to
    score: left out). Returns, per call, the packed positions of its tokens, its log-probs and its
    entropies (None unless asked)."""
    b = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(b, device=ids.device), lens)
    where, lps, ents = [], [], []
    for rows in plan.calls:
        in_call = torch.zeros(b, dtype=torch.bool, device=ids.device)
        in_call[rows] = True
        tok = in_call[seq]
        sub_cu = torch.cat([cu.new_zeros(1), lens[in_call].cumsum(0)])
        out = packed_completion_logprobs(
            model,
            ids[tok],
            sub_cu,
            plan.prompt_lens[in_call],
            plan.group_index[in_call],
            backend=impl,
            temperature=temp,
            compute_entropy=compute_entropy,
        )
        where.append(tok.nonzero().reshape(-1))
        lps.append(out.logprobs)
        ents.append(out.entropies)
    return where, lps, ents


def _rolled(
    parts: list[Any], where: list[torch.Tensor], nnz: int, zero: Any, device: torch.device
) -> torch.Tensor:
    """The calls' per-token values scattered to their packed positions in verl's rolled layout.
    Position i of a sequence holds log p(token i); verl's rolled layout wants it at i - 1. The
    element rolled in at each sequence's last position is a prompt token's 0. ``zero``: the empty
    calls' zero, added to keep them in the graph."""
    if not parts:
        return torch.zeros(nnz, device=device) + zero
    x = torch.cat(parts)
    full = x.new_zeros(nnz).index_put((torch.cat(where),), x)  # differentiable scatter
    return torch.roll(full, shifts=-1) + zero


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    group_keys: Sequence[Any] | None = None,
    temperature: float | torch.Tensor = 1.0,
    backend: str | AttentionBackend = "shared_prefix",
    compute_entropy: bool = False,
    plan: CallPlan | None = None,
    model_calls: int | None = None,
) -> PackedLogprobs:
    """Log-probs (and entropies) of every response token of a packed micro-batch, in verl's rolled
    layout ``[nnz]``. ``input_ids: [nnz]`` (or ``[1, nnz]``), ``cu_seqlens: [B + 1]``,
    ``response_lens: [B]``; sequences with an empty response contribute zeros. ``plan``: from
    :func:`plan_calls` (default: one call). ``model_calls``: backend calls to make in all (what the
    data-parallel ranks agreed on, >= the plan's): the extra ones are empty calls (:func:`_empty_call`)."""
    temp = _scalar_temperature(temperature)
    ids, cu, resp, lens = _checked_packing(input_ids, cu_seqlens, response_lens)
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    plan = plan or plan_calls(ids, cu, resp, group_keys, name)
    impl = resolve_backend(backend)
    where, lps, ents = _run_calls(model, ids, cu, lens, plan, impl, temp, compute_entropy)
    extra = max(0, (model_calls or 0) - len(plan.calls))
    zero = sum(_empty_call(model, ids, cu, resp, impl) for _ in range(extra))
    nnz = ids.numel()
    entropy = _rolled(ents, where, nnz, zero, ids.device) if compute_entropy else None
    return PackedLogprobs(_rolled(lps, where, nnz, zero, ids.device), entropy)
