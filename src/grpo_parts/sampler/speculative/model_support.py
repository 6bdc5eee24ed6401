"""Which policies the speculative sampler can serve exactly, read from the model's config
(docs/speculative.md, "Models served")."""

from __future__ import annotations

from typing import Any

import torch

from ...wrappers import sharding

#: layer kinds whose cache holds one key/value entry per token, or none (everything else is recurrent)
ATTENTION_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local"}
) | {"mlp", "moe", "-"}
#: model types with no per-token cache at all
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma"})
#: ``hybrid_override_pattern`` characters (Nemotron-H): M = Mamba-2, * = attention, - = MLP, E = MoE
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def layer_kinds(config: Any) -> list[str]:
    """Every layer kind the config names (``layer_types``, ``layers_block_type``, ``block_types``,
    ``hybrid_override_pattern``), in order of first appearance."""
    kinds: list[str] = []
    for attr in ("layer_types", "layers_block_type", "block_types", "layers_block_types"):
        try:
            v = getattr(config, attr, None)
        except Exception:  # noqa: BLE001 - a computed property may fail on a partial config
            v = None
        if isinstance(v, (list, tuple)):
            kinds += [str(x) for x in v]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        kinds += [_PATTERN.get(c, c) for c in pattern]
    return list(dict.fromkeys(kinds))


def recurrent_reasons(model: torch.nn.Module) -> list[str]:
    """Why the policy's cache cannot be rolled back to an accepted draft prefix (empty = it can)."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        return []
    mt = str(getattr(cfg, "model_type", "?"))
    other = [k for k in layer_kinds(cfg) if k not in ATTENTION_KINDS]
    if mt in RECURRENT_MODEL_TYPES or mt.endswith("mamba"):
        other = other or ["recurrent"]
    if not other:
        return []
    return [
        f"model: {mt} has recurrent/convolutional layers ({', '.join(other)}): their cache is a running "
        "state that cannot be rolled back to the accepted prefix of a verified draft, so speculative "
        "decoding cannot serve it exactly; use the reference sampler"
    ]


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window ``W`` when any layer of the policy uses one, else None."""
    cfg: Any = getattr(model, "config", None)
    w = getattr(cfg, "sliding_window", None)
    if not w or not getattr(cfg, "use_sliding_window", True):
        return None
    kinds = layer_kinds(cfg)
    if kinds and "sliding_attention" not in kinds and "local" not in kinds:
        return None  # a window size in the config that no layer uses
    return int(w)


def window_reason(window: int, width: int, max_new_tokens: int) -> str | None:
    """Why a rollout of prompt width ``width`` cannot be served exactly under window ``window``."""
    if width + max_new_tokens <= window - 1:
        return None
    return (
        f"model: sliding-window attention (sliding_window={window}): prompt width {width} + max_new_tokens "
        f"{max_new_tokens} = {width + max_new_tokens} exceeds the {window - 1} cache columns served exactly "
        "(transformers applies the window by cache column, so draft holes would count against it past that)"
    )


def sharded_reasons(policy: torch.nn.Module) -> list[str]:
    """Why a policy whose weights are sharded across processes cannot be decoded speculatively: the
    decode loop runs the policy's layers and KV caches itself, and rows finish at different steps on
    different ranks, so the wrapper's per-forward all-gathers would not meet their peers."""
    kind = sharding(policy)
    if kind is None:
        return []
    return [
        f"model: weights sharded by {kind}: the speculative decode loop runs the policy's layers "
        "outside the all-gathers every sharded forward needs; decode a gathered copy (FSDP1 "
        "summon_full_params, ZeRO-3 GatheredParameters) or use the reference sampler, whose ranks step "
        "together"
    ]
