"""Shared-prefix log-probs for verl's packed (remove-padding) micro-batches, grouped by ``uid``.

verl's FSDP engine packs a micro-batch into one row of ``nnz`` tokens (``input_ids.values()``, with
``cu_seqlens = input_ids.offsets()``), every sequence ``[prompt | response]`` carrying its whole
prompt, and returns per-token log-probs in a *rolled* layout: position ``j`` of a sequence holds
``log p(token j+1 | tokens <= j)``. This module translates such a micro-batch into a grpo_parts
:class:`~grpo_parts.attention.protocol.LogprobBatch` (prompt left-padded, response right-padded,
``group_index`` from ``uid``), runs any grpo_parts ``AttentionBackend`` by name (``shared_prefix``
encodes each prompt once per group; ``reference`` re-encodes it per row) and writes the completion
log-probs back into verl's rolled layout. Positions that do not predict a response token (the
prompt, the last token) are 0: verl's losses and metrics mask them with ``response_mask``.

:func:`install_engine_hook` makes verl's ``FSDPEngineWithLMHead.forward_step`` use it when the
environment variable ``GRPO_PARTS_VERL_ATTENTION`` names a backend (see docs/adapters/verl.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_parts.attention import get_attention_class
from grpo_parts.attention.protocol import AttentionBackend, LogprobBatch
from grpo_parts.errors import GRPOPartsError, check_tensor

from .advantage import uid_to_group_index

ENV_VAR = "GRPO_PARTS_VERL_ATTENTION"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedLogprobs:
    """``log_probs: [nnz]`` and ``entropy: [nnz]`` (or None) in verl's rolled packed layout."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


def _group_index(
    input_ids: torch.Tensor, cu: list[int], prompt_lens: list[int], group_keys: Sequence[Any] | None
) -> torch.Tensor:
    """Group rows by ``uid`` (or by identical prompt tokens when no uid is given), checking that
    rows of one uid really share their prompt -- sharing is only exact for identical prefixes."""
    prompts = [tuple(input_ids[cu[i] : cu[i] + prompt_lens[i]].tolist()) for i in range(len(prompt_lens))]
    keys = list(group_keys) if group_keys is not None else prompts
    if len(keys) != len(prompts):
        raise GRPOPartsError(f"group_keys: expected {len(prompts)} uids (one per sequence), got {len(keys)}")
    gi, _ = uid_to_group_index(keys)
    first: dict[int, int] = {}
    for row, g in enumerate(gi.tolist()):
        j = first.setdefault(g, row)
        if prompts[j] != prompts[row]:
            raise GRPOPartsError(
                f"group_keys: rows {j} and {row} share uid {keys[row]!r} but their prompts differ "
                f"(lengths {len(prompts[j])} and {len(prompts[row])})"
            )
    return gi


def packed_to_logprob_batch(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    group_keys: Sequence[Any] | None = None,
    pad_token_id: int = 0,
) -> LogprobBatch:
    """``input_ids: [nnz]`` (or ``[1, nnz]``), ``cu_seqlens: [B + 1]``, ``response_lens: [B]`` ->
    LogprobBatch with one row per sequence."""
    ids = input_ids.reshape(-1)
    check_tensor("input_ids", ids, ndim=1, dtype="int")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtype="int")
    b = cu_seqlens.numel() - 1
    check_tensor("response_lens", response_lens, shape=[b], dtype="int")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != ids.numel() or any(y < x for x, y in zip(cu, cu[1:])):
        raise GRPOPartsError(f"cu_seqlens: expected 0 .. {ids.numel()} non-decreasing, got {cu}")
    seq_lens = [cu[i + 1] - cu[i] for i in range(b)]
    resp = response_lens.tolist()
    prompt_lens = [s - r for s, r in zip(seq_lens, resp)]
    bad = [i for i in range(b) if prompt_lens[i] < 1 or resp[i] < 0]
    if bad:
        i = bad[0]
        raise GRPOPartsError(
            f"response_lens[{i}]: expected 0 <= value < sequence length {seq_lens[i]} (>= 1 prompt token), got {resp[i]}"
        )
    p_max, t_max = max(prompt_lens), max(max(resp), 1)
    prompt_ids = ids.new_full((b, p_max), pad_token_id)
    prompt_mask = ids.new_zeros((b, p_max))
    comp_ids = ids.new_full((b, t_max), pad_token_id)
    comp_mask = ids.new_zeros((b, t_max))
    for i in range(b):
        p, r, s = prompt_lens[i], resp[i], cu[i]
        prompt_ids[i, p_max - p :] = ids[s : s + p]
        prompt_mask[i, p_max - p :] = 1
        comp_ids[i, :r] = ids[s + p : s + p + r]
        comp_mask[i, :r] = 1
    gi = _group_index(ids, cu, prompt_lens, group_keys).to(ids.device)
    return LogprobBatch(prompt_ids, prompt_mask, comp_ids, comp_mask, gi)


def _rolled_positions(
    cu_seqlens: torch.Tensor, response_lens: torch.Tensor, t_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` packed position holding ``log p(response token t)`` (``cu[b] + P_b - 1 + t``) and its validity."""
    starts = cu_seqlens[:-1]
    prompt_lens = cu_seqlens[1:] - starts - response_lens
    t = torch.arange(t_max, device=cu_seqlens.device)
    pos = (starts + prompt_lens - 1)[:, None] + t[None, :]
    valid = t[None, :] < response_lens[:, None]
    return pos, valid


def resolve_backend(backend: str | AttentionBackend) -> AttentionBackend:
    return get_attention_class(backend)() if isinstance(backend, str) else backend


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
    layout ``[nnz]``, computed by the grpo_parts attention backend ``backend``."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() == 0 or bool((temperature != temperature.reshape(-1)[0]).any()):
            raise GRPOPartsError(
                f"temperature: expected one value for the micro-batch, got {temperature.tolist()}"
            )
        temperature = float(temperature.reshape(-1)[0])
    batch = packed_to_logprob_batch(input_ids, cu_seqlens, response_lens, group_keys)
    impl = resolve_backend(backend)
    out = impl.completion_logprobs(model, batch, temperature=temperature, compute_entropy=compute_entropy)
    nnz = input_ids.numel()
    pos, valid = _rolled_positions(
        cu_seqlens.to(out.logprobs.device), response_lens.to(out.logprobs.device), out.logprobs.shape[1]
    )

    def scatter(x: torch.Tensor) -> torch.Tensor:
        flat = x.new_zeros(nnz)
        return flat.index_put((pos[valid],), x[valid])  # differentiable scatter into the packed row

    ent = None if out.entropies is None else scatter(out.entropies)
    return PackedLogprobs(scatter(out.logprobs), ent)


# ------------------------------------------------------------------------------ verl engine hook


def _nested_parts(micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any] | None]:
    input_ids = micro_batch["input_ids"]
    cu = input_ids.offsets()
    # the same response lengths verl's no_padding_2_padding slices the log-probs with
    rm = micro_batch["responses"] if "responses" in micro_batch.keys() else micro_batch["response_mask"]
    if not getattr(rm, "is_nested", False):
        raise GRPOPartsError(
            "micro_batch['responses']: expected a nested (jagged) tensor in remove-padding mode"
        )
    response_lens = rm.offsets().diff()
    uid = micro_batch.get("uid", None) if hasattr(micro_batch, "get") else None
    keys = None if uid is None else (uid.tolist() if hasattr(uid, "tolist") else list(uid))
    return input_ids.values(), cu, response_lens.to(cu.device), keys


def _unsupported(engine: Any, micro_batch: Any) -> list[str]:
    from verl.utils import tensordict_utils as tu

    reasons = []
    if getattr(engine, "use_ulysses_sp", False):
        reasons.append("ulysses sequence parallelism")
    for key in ("use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared"):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            reasons.append(key)
    if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        reasons.append("use_remove_padding=False")
    if "multi_modal_inputs" in micro_batch.keys():
        reasons.append("multi-modal inputs")
    return reasons


def install_engine_hook(backend: str | None = None) -> bool:
    """Patch verl's ``FSDPEngineWithLMHead.forward_step`` so packed micro-batches go through
    :func:`packed_logprobs` with ``backend`` (default: ``$GRPO_PARTS_VERL_ATTENTION``). Micro-batches
    it cannot handle (Ulysses SP, fused kernels, top-k distillation, multi-modal) fall back to
    verl's own forward, with a warning. Returns True when installed. Idempotent."""
    name = backend or os.environ.get(ENV_VAR, "")
    if not name:
        return False
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    original = getattr(
        FSDPEngineWithLMHead.forward_step, "_grpo_parts_original", FSDPEngineWithLMHead.forward_step
    )
    impl = resolve_backend(name)

    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        reasons = _unsupported(self, micro_batch)
        if reasons:
            logger.warning(
                "grpo_parts %s attention: falling back to verl's forward (%s)", name, ", ".join(reasons)
            )
            return original(self, micro_batch, loss_function, forward_only)
        # as verl's forward_step, except on an accelerator-less host (CPU tests), where verl would fail
        micro_batch = micro_batch.to(get_device_id() if torch.accelerator.is_available() else "cpu")
        ids, cu, resp, keys = _nested_parts(micro_batch)
        entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        ctx = torch.autocast(device_type=ids.device.type, dtype=dtype, enabled=dtype != torch.float32)
        with ctx:
            out = packed_logprobs(self.module, ids, cu, resp, keys, micro_batch["temperature"], impl, entropy)
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(out.log_probs, cu)}
            if out.entropy is not None:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy, cu)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                loss, metrics = torch.tensor(1.0, device=ids.device), {}
        detached = {k: v.detach() for k, v in model_output.items()}
        return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}

    forward_step._grpo_parts_original = original  # type: ignore[attr-defined]
    FSDPEngineWithLMHead.forward_step = forward_step  # type: ignore[method-assign]
    return True


def uninstall_engine_hook() -> bool:
    """Undo :func:`install_engine_hook`; returns True when a hook was removed."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    original = getattr(FSDPEngineWithLMHead.forward_step, "_grpo_parts_original", None)
    if original is None:
        return False
    FSDPEngineWithLMHead.forward_step = original  # type: ignore[method-assign]
    return True
