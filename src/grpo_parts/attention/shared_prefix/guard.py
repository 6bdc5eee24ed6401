"""What keeps the shared-prefix backend from computing wrong numbers silently.

The layout is only correct if *every* token mixer is an attention layer that receives it. Three
checks, cheapest first: :func:`model_reasons` / :func:`architecture_reasons` from the config and
module tree; the kernel refusing keyword arguments it does not implement and recording
``layout.receipts``; :func:`layout_shortfall` after every forward (a layer that missed the layout ran
over the whole grid row, log-probs off by ~1, no error). docs/attention.md, "The guard".
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ...compat import accepts_logits_to_keep, config_values, kv_shared_through_cache
from ...errors import GRPOPartsError, NotSupportedError
from ...wrappers import inner_model, model_name
from ..vision import is_vision_model

#: ``layout_types`` entries the layout is exact for (``sparse``/``dense`` are MLP layer types)
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "sparse", "dense"})
#: class names of token mixers that are not attention (state-space, recurrent, linear attention)
_MIXER_NAME = re.compile(r"Mamba|Rwkv|RWKV|Recurrent|DeltaNet|LinearAttention|ShortConv|[MmSs]lstm|Ssm|SSM")


def text_config(model: torch.nn.Module) -> Any:
    cfg = model.config  # type: ignore[union-attr]
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def any_value(config: Any, key: str, default: Any = None) -> bool:
    """Whether ``key`` is truthy on any decoder layer of ``config`` (a per-layer config's values,
    or the global one: :func:`~grpo_parts.compat.config_values`)."""
    return any(bool(v) for v in config_values(config, key, default))


def _alibi(tc: Any) -> bool:
    attn_cfg = config_values(tc, "attn_config")[0]  # mpt
    mpt_alibi = attn_cfg.get("alibi") if isinstance(attn_cfg, dict) else getattr(attn_cfg, "alibi", False)
    return bool(
        "bloom" in config_values(tc, "model_type")
        or any_value(tc, "alibi")
        or mpt_alibi
        or "alibi" in config_values(tc, "position_embedding_type")
    )


def _mixers(model: torch.nn.Module) -> list[str]:
    """Modules that mix tokens without attention: a causal ``Conv1d`` over the sequence (state-space,
    gated delta-net and short-convolution layers all have one) or a state-space/recurrent class."""
    out = []
    for name, mod in model.named_modules():
        if not name or isinstance(mod, torch.nn.ModuleList):  # the model itself, layer lists
            continue
        conv = isinstance(mod, torch.nn.Conv1d) and mod.kernel_size[0] > 1
        if conv or _MIXER_NAME.search(type(mod).__name__):
            out.append(f"{name} ({type(mod).__name__})")
    return out


#: rotary ``rope_type`` s whose frequencies depend on the position ids alone, or (``dynamic`` NTK,
#: ``longrope``) also on the largest position id of the forward -- which the layout makes the
#: reference's (:mod:`.layout`). Any other rope type is refused: it might follow the row length.
KNOWN_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"})

#: model -> :func:`rotary_reasons` (the module tree does not change under a model object)
_ROTARY: weakref.WeakKeyDictionary[torch.nn.Module, list[str]] = weakref.WeakKeyDictionary()


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The modules the shared-prefix layout runs through: a VLM's language model (its vision tower
    has its own rotary embeddings and position tables, for image patches, run outside the layout),
    else the whole model."""
    return model.get_decoder() if is_vision_model(model) else model  # type: ignore[operator,no-any-return]


def rotary_reasons(model: torch.nn.Module, kind: str) -> list[str]:
    """Rotary embeddings whose cos/sin could differ between the grid and the reference: one that takes
    no ``position_ids`` (its tables follow the sequence length, which the grid changes) or has a rope
    type outside :data:`KNOWN_ROPE_TYPES`. Cached per model."""
    key = inner_model(model)
    if key in _ROTARY:
        return _ROTARY[key]
    out = []
    for name, mod in decoder_of(model).named_modules():
        if "Rotary" not in type(mod).__name__:
            continue
        where = f"model: {kind}: rotary embedding {name} ({type(mod).__name__})"
        if "position_ids" not in inspect.signature(mod.forward).parameters:
            out.append(f"{where} takes no position_ids: its frequencies follow the sequence length")
            continue
        rope = getattr(mod, "rope_type", None) or "default"
        unknown = sorted(
            {str(r) for r in (rope.values() if isinstance(rope, dict) else [rope])} - KNOWN_ROPE_TYPES
        )
        if unknown:
            out.append(
                f"{where} has rope_type {unknown}, not known to depend only on the position ids and the "
                "forward's largest position id"
            )
    _ROTARY[key] = out
    return out


#: model -> :func:`position_tables`
_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[str, int]]] = weakref.WeakKeyDictionary()


def position_tables(model: torch.nn.Module) -> list[tuple[str, int]]:
    """``(name, positions it holds)`` of each learned absolute position table (an ``nn.Embedding``
    other than the token embeddings: GPT-2's ``wpe``, OPT's ``embed_positions`` less its ``offset``).
    The layout never gives a position beyond the batch's longest row, so a batch fits when its
    longest row fits every table. Cached per model."""
    key = inner_model(model)
    if key in _TABLES:
        return _TABLES[key]
    get = getattr(model, "get_input_embeddings", None)
    tokens = get() if callable(get) else None
    out = []
    for name, mod in decoder_of(model).named_modules():
        last = name.rsplit(".", 1)[-1]
        table = isinstance(mod, torch.nn.Embedding) and (last == "wpe" or "position" in last)
        if table and mod is not tokens:
            out.append((name, mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)))
    _TABLES[key] = out
    return out


def architecture_reasons(model: torch.nn.Module, base: torch.nn.Module) -> list[str]:
    """Model features the grid layout cannot compute exactly, from config and modules (no forward).
    ``base``: the model whose ``forward`` gets the backend's keyword arguments (below a PEFT wrapper)."""
    tc = text_config(model)
    kind = f"{model_name(base)} ({config_values(tc, 'model_type', '?')[0]})"
    out = []
    if _alibi(tc):
        out.append(
            f"model: {kind} uses ALiBi positional bias, which transformers builds from the row's token "
            "indices and attention mask, not each sequence's positions: not implemented"
        )
    other = sorted(set(config_values(tc, "layer_types")[0] or []) - SUPPORTED_LAYER_TYPES)
    if other:
        out.append(
            f"model: {kind} has layer types {other}; only full and sliding-window attention layers are "
            "implemented (a recurrent/convolutional/chunked layer would mix the completions of a group)"
        )
    mixers = _mixers(model)
    if mixers:
        more = f" and {len(mixers) - 2} more" if len(mixers) > 2 else ""
        out.append(
            f"model: {kind} mixes tokens outside attention ({', '.join(mixers[:2])}{more}): that state "
            "would carry one completion into the next"
        )
    if any_value(tc, "attn_temperature_tuning"):
        out.append(
            f"model: {kind} scales attention by the token's row index (attn_temperature_tuning), not "
            "its position in its own sequence: not implemented"
        )
    shared = kv_shared_through_cache(model)
    if shared:
        out.append(
            f"model: {kind}: layers reuse earlier layers' keys and values through the KV cache "
            f"({', '.join(shared[:2])}{' and more' if len(shared) > 2 else ''}; transformers 4.x), and "
            "the shared-prefix forward runs without a cache: they would compute their own"
        )
    out += rotary_reasons(model, kind)
    if "position_ids" not in inspect.signature(base.forward).parameters:
        out.append(f"model: {model_name(base)}.forward has no position_ids argument")
    return out


def decoder_layer_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """Every ``ModuleList`` with ``num_hidden_layers`` entries (the decoder layers are one of them)."""
    n = config_values(text_config(model), "num_hidden_layers")[0]
    if not n:
        return []
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n
    ]


def layout_shortfall(model: torch.nn.Module, receipts: Any) -> list[str]:
    """Empty when every decoder layer holds a module that received the layout (``receipts``: the
    layout's :class:`~grpo_parts.attention.shared_prefix.layout.Receipts`, or any sized iterable of modules);
    otherwise why not, naming the model class and the first layer without it."""
    lists = decoder_layer_lists(model)
    if not lists:
        n = config_values(text_config(model), "num_hidden_layers")[0]
        return [
            f"model: {model_name(model)} has no ModuleList of num_hidden_layers={n} decoder layers, so "
            "the shared-prefix layout's arrival in every attention layer cannot be checked"
        ]
    got = {id(m) for m in receipts}
    best: tuple[str, torch.nn.ModuleList, list[int]] | None = None
    for name, layers in lists:
        missing = [i for i, layer in enumerate(layers) if not any(id(m) in got for m in layer.modules())]
        if not missing:
            return []
        if best is None or len(missing) < len(best[2]):
            best = (name, layers, missing)
    assert best is not None
    name, layers, missing = best
    i = missing[0]
    return [
        f"model: {model_name(model)}: layer {i} ({name}.{i}, {type(layers[i]).__name__}) ran without "
        f"the shared-prefix layout ({len(missing)} of {len(layers)} layers without it, "
        f"{len(receipts)} attention calls with it): its decoder layer does not pass keyword arguments to "
        "its attention, or its attention does not dispatch through transformers' AttentionInterface, "
        "so it would attend across the whole grouped row"
    ]


def _through_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``(the model whose forward gets our keyword arguments, reasons)``. A PEFT model with a weight adapter
    (LoRA and the like) passes ``logits_to_keep``, ``position_ids`` and the layout keyword unchanged to its
    base model; prompt-learning adapters add virtual tokens and activated LoRA looks for its invocation tokens
    in ``input_ids``, neither of which holds in the grouped layout. DDP, FSDP1 and DeepSpeed's engine pass
    every keyword argument on to the module they wrap (:func:`~grpo_parts.wrappers.inner_model`)."""
    model = inner_model(model)
    get_base = getattr(model, "get_base_model", None)
    cfg = getattr(model, "active_peft_config", None)
    if not callable(get_base) or cfg is None:
        return model, []
    if getattr(cfg, "is_prompt_learning", False):
        return model, [f"model: PEFT {cfg.peft_type} adds virtual tokens (prompt learning)"]
    if getattr(cfg, "alora_invocation_tokens", None):
        return model, ["model: activated LoRA (alora_invocation_tokens) reads its invocation from input_ids"]
    return get_base(), []


def model_reasons(model: torch.nn.Module, masks: tuple[torch.Tensor, torch.Tensor] | None) -> list[str]:
    """Why the shared-prefix layout cannot serve ``model`` (and a batch's prompt and completion
    ``masks``: its longest row against learned position tables and sliding windows), from the
    config and the module tree, no forward."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return [f"model: expected a transformers causal LM with .config, got {model_name(model)}"]
    if any_value(cfg, "is_encoder_decoder"):
        return [f"model: encoder-decoder models ({cfg.model_type}) are not supported"]
    tc = text_config(model)
    out = []
    if not all(config_values(tc, "is_causal", True)) or any_value(tc, "use_bidirectional_attention"):
        out.append(f"model: {tc.model_type} uses bidirectional attention")
    base, peft_reasons = _through_peft(model)
    out += peft_reasons
    if not accepts_logits_to_keep(base):
        out.append(f"model: {model_name(base)}.forward has no logits_to_keep argument")
    out += architecture_reasons(model, base)
    windows = [w for w in config_values(tc, "sliding_window") if isinstance(w, int)]
    window = min(windows) if windows else None  # (per layer in a heterogeneous config)
    uses_window = window is not None and (
        any_value(tc, "use_sliding_window", True)
        or "sliding_attention" in (config_values(tc, "layer_types")[0] or [])
    )
    tables = position_tables(base)
    if masks is not None and (tables or uses_window):  # (a host sync: only where it can matter)
        span = int((masks[0].sum(-1) + masks[1].sum(-1)).max())
        out += [
            f"model: learned position table {name} holds {rows} positions; the longest row needs {span}"
            for name, rows in tables
            if span > rows
        ]
        if uses_window and window is not None and span > window:
            out.append(
                f"model: sliding window {window} < longest sequence ({span} tokens) is not implemented"
            )
    if model.training and any(float(v or 0.0) > 0.0 for v in config_values(tc, "attention_dropout", 0.0)):
        out.append("model: attention dropout > 0 in training mode (randomness cannot match the reference)")
    return out


def model_kind(model: Any) -> str:
    """``"Qwen2ForCausalLM (qwen2)"``: the inner model's class and ``model_type``, for reasons."""
    try:
        kind = config_values(text_config(model), "model_type", "?")[0]
    except Exception:  # noqa: BLE001 - no config at all
        kind = "?"
    return f"{model_name(model)} ({kind})"


#: exceptions :func:`refusing` lets through: our own, running out of memory, a failed collective
PASSING_ERRORS: tuple[type[BaseException], ...] = (
    GRPOPartsError,
    torch.OutOfMemoryError,
    *((torch.distributed.DistError,) if hasattr(torch.distributed, "DistError") else ()),
)


@contextlib.contextmanager
def refusing(stage: str, model: Any) -> Iterator[None]:
    """Turn an unexpected exception of a ``stage`` of the shared-prefix call (the check, the plan,
    building the layout, the forward, un-grouping) into a :class:`~grpo_parts.errors.NotSupportedError`
    naming the model, the stage and the cause: a model the check accepted must never crash the backend
    with a raw ``TypeError``. :data:`PASSING_ERRORS` (not the architecture's) pass."""
    try:
        yield
    except PASSING_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a model's layout or config breaks is a refusal
        raise NotSupportedError(
            "shared_prefix", [f"model: {model_kind(model)}: {stage} failed: {type(e).__name__}: {e}"]
        ) from e
