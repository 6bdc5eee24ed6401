"""transformers compatibility: the one place that touches transformers APIs whose behaviour changed
between the releases ``pyproject.toml`` declares (``transformers>=4.56.2,<6``).

Each function says which releases do what (the floor is tested by
``scripts/ci/test-transformers-range.sh``). When a release lacks something, these raise a
:class:`~grpo_parts.errors.GRPOPartsError` naming it; nothing here falls back silently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import GRPOPartsError, NotSupportedError


@functools.cache
def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers."""
    import transformers
    from packaging.version import Version

    rel = Version(transformers.__version__).release
    return rel[0], rel[1]


# ------------------------------------------------------------------------------------------ KV cache
def new_dynamic_cache() -> Any:
    """An empty ``DynamicCache`` (no config: layers are added as the model fills them; every release)."""
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of every layer (``0 <= length <= cache length``).

    ``Cache.crop(n >= 0)`` keeps ``n`` up to 5.14 and raises (``n > 0``) or does nothing (``n = 0``)
    from 5.15.0; a negative ``n`` removes ``-n`` positions in every release, so only that is used."""
    current = int(cache.get_seq_length())
    if not 0 <= length <= current:
        raise GRPOPartsError(
            f"crop_cache: length expected in [0, {current}] (the cache length), got {length}"
        )
    if length < current:
        cache.crop(length - current)


def select_cache_rows(cache: Any, indices: torch.Tensor) -> None:
    """Keep batch rows ``indices`` (in that order), in place (every release)."""
    cache.batch_select_indices(indices)


def repeat_cache_rows(cache: Any, repeats: int) -> None:
    """Repeat each batch row ``repeats`` times (``repeat_interleave``), in place (every release)."""
    cache.batch_repeat_interleave(repeats)


def cache_layers(cache: Any) -> list[Any] | None:
    """The cache's per-layer holders with ``.keys`` / ``.values: [B, H, L, D]`` (``Cache.layers``,
    every release in range; older ones had ``key_cache`` / ``value_cache`` lists instead), or
    None for a cache without them (a recurrent-state or quantized cache, a custom class)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(ly, "keys") and hasattr(ly, "values") for ly in layers):
        return None
    return list(layers)


@functools.lru_cache(maxsize=256)
def _cache_kwarg_of(fn: Callable[..., Any]) -> str:
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        names = set()
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    return "cache" if transformers_version() >= (5, 24) else "past_key_values"


def cache_kwarg(module: Any) -> str:
    """The keyword ``module``'s forward takes its KV cache under. transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (the old name still works with a FutureWarning and goes in 5.40);
    earlier releases only know ``past_key_values``. The forward's own signature decides; a wrapper
    whose forward takes ``**kwargs`` only gets the installed release's name."""
    fn = getattr(type(module), "forward", None)
    return _cache_kwarg_of(fn) if fn is not None else _cache_kwarg_of(module)


def output_cache(out: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned: ``out.cache`` from 5.24 on
    (``out.past_key_values`` is a deprecated alias there), ``out.past_key_values`` before."""
    for name in ("cache", "past_key_values"):
        if name in getattr(type(out), "__dataclass_fields__", {}):
            value = getattr(out, name)
            if value is None:
                raise GRPOPartsError(
                    f"model output: {name} is None (was the forward called with use_cache=True?)"
                )
            return value
    raise GRPOPartsError(
        f"model output: expected a 'cache' or 'past_key_values' field, got {type(out).__name__}"
    )


# ------------------------------------------------------------------------------------------- config
def per_layer_configs(config: Any) -> list[Any] | None:
    """The per-layer configs of a heterogeneous config (``config.per_layer_config``, 5.15+; Gemma 4
    from 5.16), or None for a homogeneous config or an older release."""
    try:
        view = getattr(config, "per_layer_config", None)
        return None if view is None else list(view)
    except Exception:  # noqa: BLE001 - a config class of its own: treat as homogeneous
        return None


def config_values(config: Any, key: str, default: Any = None) -> list[Any]:
    """Every value ``key`` takes on ``config``'s decoder layers: one per layer where the config is
    heterogeneous in ``key`` (:func:`per_layer_configs`), else ``[config.key]`` (``[default]`` when
    absent). Never raises: from 5.15 a global read of a per-layer attribute raises
    ``AmbiguousGlobalPerLayerAttributeError`` (a ``RuntimeError``, which ``getattr``'s default does
    not catch). A list-valued field (Gemma 3n's per-layer ``intermediate_size``) is returned as it is:
    the caller knows what it means."""
    layers = per_layer_configs(config)
    try:
        per_layer = key in (getattr(config, "per_layer_attributes", None) or ())
    except Exception:  # noqa: BLE001
        per_layer = layers is not None
    if not per_layer:
        try:
            return [getattr(config, key, default)]
        except Exception:  # noqa: BLE001 - ambiguous global read: fall back to the layers below
            pass
    if not layers:
        return [default]
    out = []
    for c in layers:
        try:
            out.append(getattr(c, key, default))
        except Exception:  # noqa: BLE001
            out.append(default)
    return out


def kv_shared_through_cache(model: torch.nn.Module) -> list[str]:
    """Attention modules that reuse an earlier layer's keys and values (KV sharing: Gemma 3n) and
    read them *from the KV cache*: transformers 4.x (``past_key_values.shared_layers``, so without a
    cache such a layer computes its own keys and values -- another function). From 5.0 the model
    passes them in ``shared_kv_states``, with or without a cache, which the forward declares."""
    out = []
    for name, mod in model.named_modules():
        is_shared = getattr(mod, "is_kv_shared_layer", False) is True
        if is_shared and "shared_kv_states" not in inspect.signature(mod.forward).parameters:
            out.append(name)
    return out


# ----------------------------------------------------------------------------------------- attention
def register_attention_function(name: str, fn: Callable[..., Any], mask: str = "sdpa") -> None:
    """Register ``fn`` with ``AttentionInterface`` and transformers' own ``mask`` builder (``"sdpa"``:
    boolean, ``"eager"``: additive) with ``AttentionMaskInterface``, both under ``name``. The mask
    builders' signatures differ between 4.x and 5.x, so the installed release's own is registered."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    builders: dict[str, Callable[..., Any]] = {"sdpa": sdpa_mask, "eager": eager_mask, "own": _own_mask}
    if mask not in builders:
        raise GRPOPartsError(f"mask: expected one of {sorted(builders)}, got {mask!r}")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, builders[mask])


#: ``id(config)`` -> the attention implementation that config had before the outermost
#: :func:`select_attention` still in effect on it (configs define ``__eq__``, so they are not hashable)
_OWN_ATTENTION: dict[int, str | None] = {}


def own_attention(config: Any) -> str | None:
    """The attention implementation ``config`` had before :func:`select_attention` replaced it (None
    when no selection is in effect on it): what a forward that is not ours should run."""
    return _OWN_ATTENTION.get(id(config)) if config is not None else None


def own_attention_function(module: torch.nn.Module, name: str) -> Callable[..., Any] | None:
    """The function an attention ``module`` runs for implementation ``name``, as its model would call
    it: ``"eager"`` is the ``eager_attention_forward`` of the module's own modeling file (soft-capping,
    sinks and dtype handling differ per model), anything else the ``AttentionInterface`` entry (in
    every release in range). None when there is none."""
    import sys

    if name == "eager":
        return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else None


def _own_mask(*args: Any, **kwargs: Any) -> Any:
    """Mask builder of an attention function that runs the model's own attention outside its layout:
    the builder of the implementation selected before (:func:`own_attention`; transformers passes
    ``config=`` to every mask builder in range), SDPA's when there is none. An implementation without
    a mask builder gets no mask, as transformers does for it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    own = own_attention(kwargs.get("config"))
    if own is None:
        return sdpa_mask(*args, **kwargs)
    if own not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[own](*args, **kwargs)


def sdpa_attention_forward() -> Callable[..., Any]:
    """transformers' SDPA ``AttentionInterface`` function (from 5.21 it refuses ``softcap``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn

    return fn


def _attn_configs(model: torch.nn.Module) -> list[Any]:
    """The configs whose attention choice a selection writes: the model's and its sub-configs', of
    a vision-language model's only ``text_config`` (its vision tower keeps its own attention: the
    kernels here serve the text decoder's rows)."""
    cfg = model.config  # type: ignore[union-attr]
    text_only = getattr(cfg, "vision_config", None) is not None
    out = [cfg]
    for key in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, key, None)
        if sub is not None and (not text_only or key == "text_config"):
            out.append(sub)
    return out


@contextlib.contextmanager
def select_attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Select the attention function ``name`` on ``model``'s config and sub-configs for the duration
    of the block, then restore each one's previous choice. Writes ``_attn_implementation_internal``
    (what the ``_attn_implementation`` property reads in every release in range) directly: the
    public ``set_attn_implementation`` re-checks the model class and recurses into sub-configs.
    The outermost selection records each config's previous choice for :func:`own_attention`.
    A VLM's vision tower keeps its own (:func:`_attn_configs`)."""
    cfgs = _attn_configs(model)
    saved = [c._attn_implementation for c in cfgs]
    outermost = [id(c) for c in cfgs if id(c) not in _OWN_ATTENTION]
    for c, s in zip(cfgs, saved):
        _OWN_ATTENTION.setdefault(id(c), s)
        c._attn_implementation_internal = name
    try:
        yield
    finally:
        for c, s in zip(cfgs, saved):
            c._attn_implementation_internal = s
        for i in outermost:
            _OWN_ATTENTION.pop(i, None)


@contextlib.contextmanager
def own_attention_selected(model: torch.nn.Module) -> Iterator[None]:
    """For the block, ``model``'s own attention implementation where a :func:`select_attention` is
    in effect on it (e.g. a training kernel an adapter keeps selected for a whole training step,
    inside which the trainer also generates), so that a sampler decodes with the model's own
    attention and selects its own kernels over it; nothing changes otherwise."""
    cfg = getattr(model, "config", None)
    own = own_attention(cfg)
    if own is None or own == getattr(cfg, "_attn_implementation", None):
        yield
        return
    with select_attention(model, own):
        yield


def causal_lm_class(config: Any) -> type:
    """The ``AutoModelForCausalLM`` class for ``config`` (``MODEL_FOR_CAUSAL_LM_MAPPING``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls: type = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # type: ignore[assignment]
    except KeyError:
        raise GRPOPartsError(f"config: {type(config).__name__} has no AutoModelForCausalLM class") from None
    return cls


def attn_implementation(model_class: type, requested: str | None = None) -> str:
    """The ``attn_implementation`` to build ``model_class`` with: ``requested`` if given (raising
    :class:`~grpo_parts.errors.NotSupportedError` for ``"sdpa"`` where the class lacks it), else
    ``"sdpa"`` where supported and ``"eager"`` otherwise -- transformers' own default. SDPA support
    is per class *and* release: Gemma2 has it up to 5.20 and not from 5.21 (SDPA cannot soft-cap
    attention logits), where ``from_config(..., attn_implementation="sdpa")`` raises."""
    sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if requested is None:
        return "sdpa" if sdpa else "eager"
    if requested == "sdpa" and not sdpa:
        import transformers

        raise NotSupportedError(
            model_class.__name__,
            [f"attn_implementation='sdpa' is not supported by transformers {transformers.__version__}"],
        )
    return requested


def use_eager_experts(config: Any) -> None:
    """Run MoE experts as a loop (``"eager"``) on ``config`` and its sub-configs: from 5.0 transformers
    picks ``grouped_mm``, which has no float64 kernel (4.x blocks are loops already)."""
    for c in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {})]:
        if c is not None and hasattr(c, "_experts_implementation"):
            c._experts_implementation = "eager"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` declares ``logits_to_keep`` (every transformers causal LM in range;
    remote-code models and wrappers may not)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


# ---------------------------------------------------------------------------------------- tokenizer
def portable_tokenizer_config(folder: str | Path) -> None:
    """Make a saved fast tokenizer loadable by every release in range. 5.x's ``save_pretrained``
    writes ``"tokenizer_class": "TokenizersBackend"``, a class 4.x's ``AutoTokenizer`` does not know
    (``ValueError``); ``PreTrainedTokenizerFast`` names the same tokenizer in 4.x and 5.x."""
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
