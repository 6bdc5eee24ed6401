"""Build the four parts from :class:`~.config.PartsConfig` by name, through the IMPLEMENTATIONS tables.

A *default* name that is not in this installation's table falls back to the reference with a logged
note (so the default run works while optimized parts are still landing); a name the user set
explicitly must exist. Each part is then asked ``not_supported_reasons`` and refuses clearly.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from ..errors import GRPOPartsError, NotSupportedError
from .config import REFERENCE_PARTS, PartsConfig

log = logging.getLogger("grpo_parts.train")

#: constructor arguments used when the config gives none for that part
DEFAULT_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "filter": {"cppo": {"pruning_rate": 0.75}, "pods": {"pruning_rate": 0.5}},
}


@dataclass
class Parts:
    sampler: Any
    attention: Any
    filter: Any
    draft: Any | None = None
    names: dict[str, str | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.names.items())


def _table(part: str) -> dict[str, str]:
    import importlib

    return dict(importlib.import_module(f"grpo_parts.{part}").IMPLEMENTATIONS)


def resolve_name(part: str, cfg: PartsConfig, notes: list[str]) -> str | None:
    """The implementation name to use for ``part`` (``None`` only for ``draft``)."""
    name = getattr(cfg, part)
    if name is None:
        return None
    table = _table(part)
    if name in table:
        return str(name)
    if part in cfg.model_fields_set:
        raise GRPOPartsError(
            f"parts.{part}: unknown implementation {name!r}; expected one of {sorted(table)}"
        )
    fallback = REFERENCE_PARTS[part]
    note = f"parts.{part}: {name!r} is not available in this installation; using the reference {fallback!r}"
    log.warning(note)
    notes.append(note)
    return fallback


def _kwargs(part: str, name: str, given: dict[str, Any], cfg: PartsConfig | None = None) -> dict[str, Any]:
    if cfg is not None and getattr(cfg, part) != name:
        given = {}  # a fallback: the kwargs were meant for the part that is missing
    return dict(given) if given else dict(DEFAULT_KWARGS.get(part, {}).get(name, {}))


def _construct(cls: Any, policy: torch.nn.Module, kwargs: dict[str, Any], extra: dict[str, Any]) -> Any:
    """Call ``cls`` with the policy (first positional argument when it takes one) and ``kwargs``;
    a pydantic ``config`` argument is built from ``kwargs`` when the class takes one."""
    sig = inspect.signature(cls)
    params = list(sig.parameters.values())
    args: list[Any] = []
    kw = dict(kwargs)
    if params and params[0].name in ("model", "policy") and params[0].default is inspect.Parameter.empty:
        args.append(policy)
    for k, v in extra.items():
        if k in sig.parameters:
            kw[k] = v
    if "config" in sig.parameters and kwargs and not set(kwargs) & set(sig.parameters):
        ann = sig.parameters["config"].annotation
        cfg_cls = _config_class(cls, ann)
        if cfg_cls is not None:
            kw = {k: v for k, v in kw.items() if k not in kwargs}
            kw["config"] = cfg_cls(**kwargs)
    return cls(*args, **kw)


#: plain annotations checked before a (non-pydantic) constructor sees the value
_PLAIN_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def _check_kwargs(cls: Any, kwargs: dict[str, Any], where: str, what: str) -> None:
    """Unknown names, and values of the wrong plain type, as one-line errors (pydantic configs check
    their own fields; the constructors check ranges)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = set(params) - {"model", "policy", "draft"}
    cfg_cls = _config_class(cls, params["config"].annotation) if "config" in params else None
    if cfg_cls is not None and hasattr(cfg_cls, "model_fields"):
        accepted = (accepted - {"config"}) | set(cfg_cls.model_fields)
    for key, value in kwargs.items():
        if key not in accepted:
            raise GRPOPartsError(
                f"{where}.{key}: {what} has no argument {key!r} (got {value!r}); "
                f"expected one of {sorted(accepted)}"
            )
        ann = params[key].annotation if key in params and not hasattr(cls, "model_fields") else None
        want = _PLAIN_TYPES.get(ann if isinstance(ann, str) else getattr(ann, "__name__", ""))
        if want and (not isinstance(value, want) or (bool not in want and isinstance(value, bool))):
            rule = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
            raise GRPOPartsError(f"{where}.{key}: expected {rule}, got {value!r} ({what})")


def _build(
    part: str, name: str, cls: Any, policy: torch.nn.Module, kwargs: dict[str, Any], extra: dict[str, Any]
) -> Any:
    """:func:`_construct`, with a bad ``parts.<part>_kwargs`` entry reported in one line naming the part,
    the field, the value and the rule (the constructors' own checks say the rule)."""
    where, what = f"parts.{part}_kwargs", f"{part} {name!r}"
    _check_kwargs(cls, kwargs, where, what)
    try:
        return _construct(cls, policy, kwargs, extra)
    except ValidationError as e:
        errs = [
            f"{where}.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}, got {err.get('input')!r} ({what})"
            for err in e.errors()
        ]
        raise GRPOPartsError("; ".join(errs)) from None
    except (NotSupportedError, ImportError):
        raise
    except (ValueError, TypeError) as e:
        if not kwargs:  # not about the kwargs: the part's own error, as it is
            raise
        raise GRPOPartsError(
            f"{where}: {what} rejected {kwargs!r}: {str(e).strip().splitlines()[0]}"
        ) from None


def _config_class(cls: Any, ann: Any) -> Any:
    import sys

    if isinstance(ann, str):
        mod = sys.modules[cls.__module__]
        name = ann.split("|")[0].strip()
        return getattr(mod, name, None)
    return ann if isinstance(ann, type) else None


def build_parts(cfg: PartsConfig, policy: torch.nn.Module) -> Parts:
    """Instantiate sampler (with its draft), attention backend and filter for ``policy``."""
    from ..attention import get_attention_class
    from ..draft import get_draft_class
    from ..filter import get_filter_class
    from ..sampler import get_sampler_class

    notes: list[str] = []
    names = {p: resolve_name(p, cfg, notes) for p in ("sampler", "draft", "attention", "filter")}
    sampler_name = names["sampler"]
    assert sampler_name is not None
    sampler_cls = get_sampler_class(sampler_name)
    takes_draft = "draft" in inspect.signature(sampler_cls).parameters
    draft = None
    if takes_draft:
        if names["draft"] is None:
            raise GRPOPartsError(f"parts.draft: sampler {sampler_name!r} needs a draft, got None")
        draft = _build(
            "draft",
            names["draft"],
            get_draft_class(names["draft"]),
            policy,
            _kwargs("draft", names["draft"], cfg.draft_kwargs, cfg),
            {},
        )
    else:
        names["draft"] = None
    skw = _kwargs("sampler", sampler_name, cfg.sampler_kwargs, cfg)
    if sampler_name == "speculative":
        skw.setdefault("train_draft", False)  # the loop trains the draft itself (and times it)
    sampler = _build("sampler", sampler_name, sampler_cls, policy, skw, {"draft": draft} if draft else {})
    attention = _build(
        "attention",
        str(names["attention"]),
        get_attention_class(str(names["attention"])),
        policy,
        _kwargs("attention", str(names["attention"]), cfg.attention_kwargs, cfg),
        {},
    )
    filt = _build(
        "filter",
        str(names["filter"]),
        get_filter_class(str(names["filter"])),
        policy,
        _kwargs("filter", str(names["filter"]), cfg.filter_kwargs, cfg),
        {},
    )
    reasons = attention.not_supported_reasons(policy)
    if reasons:
        raise NotSupportedError(f"attention {names['attention']!r}", reasons)
    return Parts(sampler, attention, filt, draft, names, notes)
