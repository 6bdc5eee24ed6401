"""Shared-prefix log-probs inside verl's FSDP engine, for the engines whose config asks for them: verl 0.9.1
has no hook between an engine's micro-batch and its model forward, so :func:`install_engine_hook` puts a
dispatcher in front of ``FSDPEngineWithLMHead.forward_step``. Other engines, and micro-batches the backend
cannot serve, run verl's forward; what ran is counted in the micro-batch's metrics
(``actor/parts/attention/...``). docs/adapters/verl.md, the attention part and "Memory"."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from grpo_parts.attention.protocol import Plans, RankAgreeing
from grpo_parts.counters import (
    ATTENTION_CALLS,
    FALLBACKS,
    GRID_OVER_PACKED_MAX,
    GRID_OVER_PADDING_FREE_MAX,
    GRID_TOKENS,
    LOGPROB,
    PACKED_TOKENS,
    PADDING_FREE_TOKENS,
    PART_UNITS,
    PartCounters,
    attention_calls,
    framework_key,
)
from grpo_parts.doors.agreement import agree_fallback
from grpo_parts.errors import NotSupportedError
from grpo_parts.types import VisionInputs

from .attention import PackedCall, packed_call, run_packed, scalar_temperature
from .options import EngineOptions, options_of

logger = logging.getLogger(__name__)
#: what ran in this process: ``mode`` is ``"train"`` (actor update) or ``"logprob"`` (forward only)
COUNTERS = PartCounters({"attention": PART_UNITS["attention"]}, logger)
_STATE_ATTR = "_grpo_parts_attention"
_pending_logprob = False


def fallback_reason(micro_batch: Any, opts: EngineOptions) -> str | None:
    """Why this micro-batch must run verl's own forward (None: grpo_parts computes it). Images are
    served (:func:`_images`); their 3-D position ids are the backend's own, from the model's
    ``get_rope_index`` as verl's data path computes them."""
    from verl.utils import tensordict_utils as tu

    keys = ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared")
    flags = [k for k in keys if tu.get_non_tensor_data(data=micro_batch, key=k, default=False)]
    if flags:
        return ", ".join(flags)
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor) and t.numel() > 1 and bool((t != t.reshape(-1)[0]).any()):
        return "per-sample temperatures"
    return None


def _images(micro_batch: Any, device: torch.device) -> VisionInputs | None:
    """Each sequence's ``multi_modal_inputs`` (verl stores one dict per sample, ``{}`` for text: the
    v1 agent loop writes it into every text sample) as :class:`VisionInputs`; None when every one
    is empty (a text micro-batch)."""
    if "multi_modal_inputs" not in micro_batch.keys():
        return None
    items = micro_batch["multi_modal_inputs"]
    items = items.tolist() if hasattr(items, "tolist") else list(items)
    per = [dict(getattr(x, "data", x) or {}) for x in items]
    if not any(per):
        return None
    return VisionInputs(tuple({k: torch.as_tensor(v).to(device) for k, v in m.items()} for m in per))


def _parts(micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any] | None]:
    """``(input_ids [nnz], cu_seqlens [B+1], response_lens [B], uids)`` of a nested micro-batch."""
    input_ids = micro_batch["input_ids"]
    cu = input_ids.offsets()
    # the response lengths verl's no_padding_2_padding slices the log-probs with
    resp = micro_batch["responses"] if "responses" in micro_batch.keys() else micro_batch["response_mask"]
    uid = micro_batch.get("uid", None) if hasattr(micro_batch, "get") else None
    keys = None if uid is None else (uid.tolist() if hasattr(uid, "tolist") else list(uid))
    return input_ids.values(), cu, resp.offsets().diff().to(cu.device), keys


def _dispatch_on_layout(model: Any) -> None:
    """Make the model's own attention function run the shared-prefix kernel whenever the layout
    keyword is present: verl's gradient checkpointing re-runs each layer in ``backward``, after the
    backend's kernel selection is undone. Without the keyword the original function runs."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from grpo_parts.attention.shared_prefix.kernels import shared_prefix_attention
    from grpo_parts.attention.shared_prefix.layout import LAYOUT_KWARG

    name = model.config._attn_implementation
    if name not in ALL_ATTENTION_FUNCTIONS:
        if getattr(model, "is_gradient_checkpointing", False):
            raise NotSupportedError(
                "grpo_parts attention",
                [f"gradient checkpointing with attn_implementation={name!r} (use sdpa or flash_attention_2)"],
            )
        return
    current = ALL_ATTENTION_FUNCTIONS[name]
    if getattr(current, "_grpo_parts_original", None) is not None:
        return

    def attention(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kw: Any
    ) -> Any:
        if kw.get(LAYOUT_KWARG) is not None and getattr(module, "is_causal", True):
            return shared_prefix_attention(module, query, key, value, attention_mask, *args, **kw)
        # a VLM's vision tower shares the attention name and gets the forward's keywords too: its
        # own (non-causal) attention runs; a decoder layer that skipped the kernel is caught by the
        # layout's receipts (layout_shortfall), never served silently
        kw.pop(LAYOUT_KWARG, None)
        return current(module, query, key, value, attention_mask, *args, **kw)

    attention._grpo_parts_original = current  # type: ignore[attr-defined]
    AttentionInterface.register(name, attention)


def _engine_state(engine: Any, opts: EngineOptions) -> Any:
    """Per-engine backend, built (and the engine checked) on its first micro-batch."""
    state = engine.__dict__.get(_STATE_ATTR)
    if state is None or state[0] is not opts:
        reasons = []
        if getattr(engine, "use_ulysses_sp", False):
            reasons.append("Ulysses sequence parallelism (refused at config time; engine built around it)")
        if getattr(getattr(engine, "engine_config", None), "use_fused_kernels", False):
            reasons.append("use_fused_kernels=True")
        if reasons:
            raise NotSupportedError(f"grpo_parts.attention={opts.attention!r}", reasons)
        if opts.attention == "shared_prefix":
            _dispatch_on_layout(engine.module)
        role = "reference" if getattr(engine.engine_config, "forward_only", False) else "actor"
        logger.info("grpo_parts: %s attention computes the %s engine's log-probs", opts.attention, role)
        backend = opts.backend()
        if isinstance(backend, RankAgreeing) and hasattr(engine, "get_data_parallel_group"):
            backend.rank_group = engine.get_data_parallel_group()  # the ranks that agree on grid counts
        state = (opts, backend)
        engine.__dict__[_STATE_ATTR] = state
    return state[1]


def _metric(value: float, how: str = "SUM") -> Any:
    from verl.utils.metric.utils import AggregationType, Metric

    return Metric(aggregation=AggregationType[how], value=float(value))


def _report(metrics: dict, ran: bool, forward_only: bool, tokens: tuple[float, int, int] | None) -> dict:
    global _pending_logprob
    out = dict(metrics)
    key = partial(framework_key, "attention")
    out[key(PART_UNITS["attention"])] = _metric(ran)
    out[key(FALLBACKS)] = _metric(not ran)
    if tokens is not None:
        out[key(GRID_TOKENS)] = _metric(tokens[0])
        out[key(PACKED_TOKENS)] = _metric(tokens[1])
        out[key(PADDING_FREE_TOKENS)] = _metric(tokens[2])
        out[key(GRID_OVER_PACKED_MAX)] = _metric(tokens[0] / max(1, tokens[1]), "MAX")
        out[key(GRID_OVER_PADDING_FREE_MAX)] = _metric(tokens[0] / max(1, tokens[2]), "MAX")
    if forward_only:
        _pending_logprob = True
    elif _pending_logprob:
        _pending_logprob = False
        for k, v in COUNTERS.flush("logprob").items():
            out[key(LOGPROB + k.rsplit("/", 1)[1])] = _metric(v)
    COUNTERS.flush("train")
    return out


@dataclass(frozen=True)
class _Prepared:
    """A micro-batch ready to run: its backend call and, for a backend that plans, its plan."""

    call: PackedCall
    plan: Any
    cu: torch.Tensor

    def tokens(self) -> tuple[float, int, int]:
        """``(tokens the layout runs, packed tokens, padding-free tokens)``."""
        if self.plan is not None:
            return self.plan.tokens, self.call.nnz, self.plan.padding_free_tokens
        b = self.call.batch  # a backend without a plan pads [prompt | completion] rows
        return float(b.prompt_ids.numel() + b.completion_ids.numel()), self.call.nnz, self.call.nnz


def _prepare(engine: Any, micro_batch: Any, opts: EngineOptions) -> tuple[_Prepared | None, str | None]:
    """``(the micro-batch's call and plan, reason)``: why it must run verl's forward instead
    (``None``: it need not). The plan is this rank's own; :func:`_agree` makes the ranks agree."""
    ids, cu, resp, keys = _parts(micro_batch)
    call = packed_call(ids, cu, resp, keys, _images(micro_batch, ids.device))
    if call is None:
        return None, "no sequence of the micro-batch has a response token"
    backend = _engine_state(engine, opts)
    # image prompts run in grids of whole prompts, never bounded as packed rows (max_padding_ratio
    # below still compares the grid with verl's packed tokens)
    rows_bound = call.batch.vision is None
    try:
        plan = (
            backend.plan(engine.module, call.batch, packed=rows_bound, agree=False)
            if isinstance(backend, Plans)
            else None
        )
    except NotSupportedError as e:
        return None, str(e)
    prepared = _Prepared(call, plan, cu)
    grid, packed, _ = prepared.tokens()
    if opts.max_padding_ratio is not None and grid > opts.max_padding_ratio * packed:
        return prepared, f"grouped layout > max_padding_ratio={opts.max_padding_ratio} x packed tokens"
    return prepared, None


def _forward_step(
    engine: Any, micro_batch: Any, loss_function: Any, prepared: _Prepared, opts: EngineOptions
) -> Any:
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.workers.engine.utils import detach_tree

    backend = _engine_state(engine, opts)
    cu = prepared.cu
    entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    ctx = (
        nullcontext()
        if dtype == torch.float32
        else torch.autocast(device_type=get_device_name(), dtype=dtype)
    )
    with ctx:
        before = attention_calls(backend)
        temp = scalar_temperature(micro_batch["temperature"])
        out = run_packed(engine.module, prepared.call, backend, temp, bool(entropy), prepared.plan)
        ran = attention_calls(backend) - before
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(out.log_probs, cu)}
        if out.entropy is not None:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy, cu)
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group()
            )
        else:
            loss, metrics = torch.tensor(1.0, device=cu.device), {}
        calls = {framework_key("attention", ATTENTION_CALLS + k): _metric(v) for k, v in ran.items()}
        metrics = {**metrics, **calls}
    return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def install_engine_hook() -> bool:
    """Put the dispatcher in front of verl's ``FSDPEngineWithLMHead.forward_step`` (idempotent;
    returns True when it was installed by this call). Engines without options are unaffected."""
    from verl.utils.device import get_device_id, get_device_name
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    original = FSDPEngineWithLMHead.forward_step
    if hasattr(original, "_grpo_parts_original"):
        return False

    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        opts = options_of(getattr(self, "engine_config", None))
        if opts is None or isinstance(self, FSDPEngineWithValueHead):
            return original(self, micro_batch, loss_function, forward_only)
        mode = "logprob" if forward_only else "train"
        reason = fallback_reason(micro_batch, opts)
        prepared, tokens = None, None
        if reason is None:
            micro_batch = micro_batch.to(get_device_id())  # as verl's forward_step
            prepared, reason = _prepare(self, micro_batch, opts)
            tokens = prepared.tokens() if prepared is not None else None
        calls = 0 if prepared is None else (prepared.plan.model_calls if prepared.plan is not None else 1)
        group = self.get_data_parallel_group() if hasattr(self, "get_data_parallel_group") else None
        reason, calls = agree_fallback(
            reason, calls, group, torch.device(get_device_name()),
            other="another data-parallel rank runs verl's forward for this micro-batch (ranks agree)",
        )  # fmt: skip
        if reason is not None or prepared is None:
            COUNTERS.fell_back("attention", reason or "no backend call", mode=mode)
            result = original(self, micro_batch, loss_function, forward_only)
        else:
            COUNTERS.ran("attention", mode=mode)
            if prepared.plan is not None:
                prepared = replace(prepared, plan=prepared.plan.agreed(calls))
            result = _forward_step(self, micro_batch, loss_function, prepared, opts)
        loss, output = result
        output["metrics"] = _report(output.get("metrics") or {}, reason is None, forward_only, tokens)
        return loss, output

    forward_step._grpo_parts_original = original  # type: ignore[attr-defined]
    FSDPEngineWithLMHead.forward_step = forward_step  # type: ignore[method-assign]
    return True


def uninstall_engine_hook() -> bool:
    """Undo :func:`install_engine_hook` and the attention wrappers of :func:`_dispatch_on_layout`;
    returns True when a hook was removed."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    for name in list(ALL_ATTENTION_FUNCTIONS):
        wrapped = getattr(ALL_ATTENTION_FUNCTIONS[name], "_grpo_parts_original", None)
        if wrapped is not None:
            AttentionInterface.register(name, wrapped)
    original = getattr(FSDPEngineWithLMHead.forward_step, "_grpo_parts_original", None)
    if original is None:
        return False
    FSDPEngineWithLMHead.forward_step = original  # type: ignore[method-assign]
    return True
