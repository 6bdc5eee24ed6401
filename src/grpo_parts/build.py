"""The one builder of every part: a name (or ``"auto"``) plus kwargs -> an instance, for every door
(``grpo_parts train`` and the TRL, verl and OpenRLHF adapters), with one set of rules:

* by name through the part's ``IMPLEMENTATIONS`` table; an instance passes through unchanged (kwargs
  with it are an error);
* the policy goes to the class one way: positionally, when its first parameter is a required
  ``model`` / ``policy`` the kwargs do not name themselves (:func:`policy_arg`);
* kwargs are checked first (unknown names, wrong plain types), then passed to the constructor or
  used to build its pydantic ``config``; every error about them is one line naming the field;
* ``"auto"`` (attention) is resolved here only (:func:`choose_attention`), logged once.

Train-only rules stay in :mod:`grpo_parts.train.step.parts`. This module never imports
``grpo_parts.train`` or the adapters.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError

from .attention import AUTO_PRIORITY as ATTENTION_PRIORITY
from .attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from .attention import AttentionBackend, get_attention_class
from .draft import DraftModel, get_draft_class
from .errors import GRPOPartsError, NotSupportedError
from .filter import CompletionFilter, get_filter_class
from .registry import Choice, choose
from .sampler import Sampler, get_sampler_class
from .skip import PromptSkipper, get_skipper_class

log = logging.getLogger("grpo_parts.build")

#: the parts :func:`build_part` builds by kind (a prompt skipper: :func:`build_prompt_skipper`)
PART_KINDS: tuple[str, ...] = ("sampler", "draft", "attention", "filter")

#: constructor arguments used when none are given for that part
DEFAULT_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "filter": {"cppo": {"pruning_rate": 0.75}, "pods": {"pruning_rate": 0.5}}
}

#: names of the parameter that takes the policy (the first one, when required)
POLICY_ARGS = ("model", "policy")

#: plain annotations checked before a (non-pydantic) constructor sees the value
_PLAIN_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def implementations(part: str) -> dict[str, str]:
    """``part``'s ``IMPLEMENTATIONS`` table (name -> ``"module:Class"``)."""
    import importlib

    if part not in PART_KINDS:
        raise GRPOPartsError(f"part: expected one of {list(PART_KINDS)}, got {part!r}")
    return dict(importlib.import_module(f"grpo_parts.{part}").IMPLEMENTATIONS)


def policy_arg(cls: Any) -> str | None:
    """The parameter of ``cls`` the policy goes to (its first, a required ``model``/``policy``)."""
    params = list(inspect.signature(cls).parameters.values())
    if params and params[0].name in POLICY_ARGS and params[0].default is inspect.Parameter.empty:
        return params[0].name
    return None


def takes_draft(cls: Any) -> bool:
    """Whether a sampler class takes a draft model."""
    return "draft" in inspect.signature(cls).parameters


def _config_class(cls: Any, ann: Any) -> Any:
    if isinstance(ann, str):
        mod = sys.modules[cls.__module__]
        name = ann.split("|")[0].strip()
        return getattr(mod, name, None)
    return ann if isinstance(ann, type) else None


def construct(
    cls: Any,
    policy: torch.nn.Module | None,
    kwargs: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """Call ``cls`` with the policy (see :func:`policy_arg`), ``kwargs`` and those ``extra`` entries
    its signature names; a pydantic ``config`` argument is built from ``kwargs`` when the class takes
    one and none of the given names."""
    sig = inspect.signature(cls)
    args: list[Any] = []
    kw = dict(kwargs)
    name = policy_arg(cls)
    if name is not None and name not in kw:
        args.append(policy)
    for k, v in (extra or {}).items():
        if k in sig.parameters:
            kw[k] = v
    if "config" in sig.parameters and kwargs and not set(kwargs) & set(sig.parameters):
        cfg_cls = _config_class(cls, sig.parameters["config"].annotation)
        if cfg_cls is not None:
            kw = {k: v for k, v in kw.items() if k not in kwargs}
            kw["config"] = cfg_cls(**kwargs)
    return cls(*args, **kw)


def accepted_kwargs(cls: Any) -> set[str] | None:
    """The kwargs names ``cls`` takes (its parameters, or its pydantic config's fields, or the whole
    ``config``); ``None`` when it takes ``**kwargs``."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return (set(params) - {"draft"}) | _config_fields(cls)


def _config_fields(cls: Any) -> set[str]:
    """The fields of the pydantic ``config`` ``cls`` takes (none when it takes no such config)."""
    params = inspect.signature(cls).parameters
    cfg_cls = _config_class(cls, params["config"].annotation) if "config" in params else None
    return set(cfg_cls.model_fields) if cfg_cls is not None and hasattr(cfg_cls, "model_fields") else set()


def check_kwargs(cls: Any, kwargs: Mapping[str, Any], where: str, what: str) -> None:
    """Unknown names, and values of the wrong plain type, as one-line errors (pydantic configs check
    their own fields; the constructors check ranges)."""
    accepted = accepted_kwargs(cls)
    if accepted is None:
        return
    params = inspect.signature(cls).parameters
    for key, value in kwargs.items():
        if key not in accepted:
            shown = accepted - set(POLICY_ARGS) - ({"config"} if _config_fields(cls) else set())
            raise GRPOPartsError(
                f"{where}.{key}: {what} has no argument {key!r} (got {value!r}); expected one of {sorted(shown)}"
            )
        if key == policy_arg(cls) and not isinstance(value, torch.nn.Module):
            raise GRPOPartsError(
                f"{where}.{key}: expected a torch.nn.Module (default: the policy), got {value!r} ({what})"
            )
        ann = params[key].annotation if key in params and not hasattr(cls, "model_fields") else None
        want = _PLAIN_TYPES.get(ann if isinstance(ann, str) else getattr(ann, "__name__", ""))
        if want and (not isinstance(value, want) or (bool not in want and isinstance(value, bool))):
            rule = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
            raise GRPOPartsError(f"{where}.{key}: expected {rule}, got {value!r} ({what})")


def _named(
    part: str,
    name: str,
    cls: Any,
    policy: torch.nn.Module | None,
    kwargs: Mapping[str, Any] | None,
    where: str,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """:func:`construct` ``cls`` (registered as ``name``), a bad kwargs entry reported in one line
    naming ``where``, the field, the value and the rule (the constructors' own checks say the rule)."""
    kw = dict(kwargs) if kwargs else dict(DEFAULT_KWARGS.get(part, {}).get(name, {}))
    what = f"{part} {name!r}"
    check_kwargs(cls, kw, where, what)
    arg = policy_arg(cls)
    if arg is not None and arg not in kw and policy is None:
        raise GRPOPartsError(f"{part}: {name!r} is built on the policy model ({arg}=), got None")
    try:
        return construct(cls, policy, kw, extra)
    except ValidationError as e:
        errs = [
            f"{where}.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}, got {err.get('input')!r} ({what})"
            for err in e.errors()
        ]
        raise GRPOPartsError("; ".join(errs)) from None
    except (NotSupportedError, ImportError):
        raise
    except (ValueError, TypeError) as e:
        if not kw:  # not about the kwargs: the part's own error, as it is
            raise
        raise GRPOPartsError(f"{where}: {what} rejected {kw!r}: {str(e).strip().splitlines()[0]}") from None


def _no_kwargs(part: str, kwargs: Mapping[str, Any] | None, where: str) -> None:
    if kwargs:
        raise GRPOPartsError(f"{where}: only used when {part} is given by name, got {sorted(kwargs)}")


def build_sampler(
    spec: str | Sampler,
    policy: torch.nn.Module | None,
    *,
    draft: DraftModel | None = None,
    kwargs: Mapping[str, Any] | None = None,
    where: str = "sampler_kwargs",
) -> Sampler:
    """The sampler ``spec`` names (an instance as is), on ``policy``, with ``draft`` when its class
    takes one (required when the class needs one)."""
    if not isinstance(spec, str):
        _no_kwargs("sampler", kwargs, where)
        if draft is not None:
            raise GRPOPartsError("draft: only used with a sampler given by name (e.g. sampler='speculative')")
        return spec
    cls = get_sampler_class(spec)
    extra: dict[str, Any] = {}
    if takes_draft(cls):
        needed = inspect.signature(cls).parameters["draft"].default is inspect.Parameter.empty
        if draft is None and needed:
            raise GRPOPartsError(f"draft: sampler {spec!r} needs a draft, got None")
        if draft is not None:
            extra["draft"] = draft
    elif draft is not None:
        raise GRPOPartsError(f"draft: sampler {spec!r} takes no draft, got {type(draft).__name__}")
    return _named("sampler", spec, cls, policy, kwargs, where, extra)  # type: ignore[no-any-return]


def build_draft(
    spec: str | DraftModel | None,
    policy: torch.nn.Module | None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    where: str = "draft_kwargs",
) -> DraftModel | None:
    """The draft ``spec`` names (an instance as is; ``None``: no draft), built on ``policy`` where
    its class takes a model (see :func:`policy_arg`)."""
    if spec is None or not isinstance(spec, str):
        _no_kwargs("draft", kwargs, where)
        return spec
    return _named("draft", spec, get_draft_class(spec), policy, kwargs, where)  # type: ignore[no-any-return]


def _auto_kwargs(cls: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Under ``"auto"`` the kwargs are for the backends that take them; the others get none."""
    accepted = accepted_kwargs(cls)
    return dict(kwargs) if accepted is None or set(kwargs) <= accepted else {}


def choose_attention(
    policy: torch.nn.Module,
    kwargs: Mapping[str, Any] | None = None,
    *,
    logger: logging.Logger | None = None,
    where: str = "attention_kwargs",
) -> tuple[Choice, dict[str, Any]]:
    """``attention="auto"``: the first backend of ``AUTO_PRIORITY`` that supports ``policy``
    (each built with the kwargs it takes), and the kwargs the chosen one takes. The kwargs must fit
    the first backend of the priority. The choice is logged once, at INFO."""
    kw = dict(kwargs or {})
    if kw:
        try:
            first = get_attention_class(ATTENTION_PRIORITY[0])
        except ImportError:
            first = None
        if first is not None:
            check_kwargs(first, kw, where, f"attention {ATTENTION_PRIORITY[0]!r} (chosen by 'auto')")

    def reasons_for(cls: Any) -> list[str]:
        return list(construct(cls, policy, _auto_kwargs(cls, kw)).not_supported_reasons(policy))

    choice = choose(ATTENTION_IMPLEMENTATIONS, ATTENTION_PRIORITY, "attention", reasons_for)
    (logger or log).info("grpo_parts: attention='auto' %s", choice.explain().replace("\n", "; "))
    return choice, _auto_kwargs(get_attention_class(choice.name), kw)


def build_attention(
    spec: str | AttentionBackend,
    policy: torch.nn.Module | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    where: str = "attention_kwargs",
    logger: logging.Logger | None = None,
) -> AttentionBackend:
    """The attention backend ``spec`` names (an instance as is); ``"auto"`` needs ``policy`` and is
    resolved by :func:`choose_attention`."""
    if not isinstance(spec, str):
        _no_kwargs("attention", kwargs, where)
        return spec
    if spec == "auto":
        if policy is None:
            raise GRPOPartsError("attention: 'auto' needs the model to choose a backend")
        choice, kwargs = choose_attention(policy, kwargs, logger=logger, where=where)
        spec = choice.name
    cls = get_attention_class(spec)
    return _named("attention", spec, cls, policy, kwargs, where)  # type: ignore[no-any-return]


def build_filter(
    spec: str | CompletionFilter, *, kwargs: Mapping[str, Any] | None = None, where: str = "filter_kwargs"
) -> CompletionFilter:
    """The completion filter ``spec`` names (an instance as is)."""
    if not isinstance(spec, str):
        _no_kwargs("filter", kwargs, where)
        return spec
    return _named("filter", spec, get_filter_class(spec), None, kwargs, where)  # type: ignore[no-any-return]


def build_prompt_skipper(
    spec: str | PromptSkipper, *, kwargs: Mapping[str, Any] | None = None, where: str = "prompt_skip_kwargs"
) -> PromptSkipper:
    """The prompt skipper ``spec`` names in ``grpo_parts.skip.IMPLEMENTATIONS`` (an instance as is)."""
    if not isinstance(spec, str):
        _no_kwargs("prompt_skip", kwargs, where)
        return spec
    cls = get_skipper_class(spec)
    return _named("prompt_skip", spec, cls, None, kwargs, where)  # type: ignore[no-any-return]


def build_part(
    part: str,
    spec: Any,
    policy: torch.nn.Module | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    draft: DraftModel | None = None,
    where: str | None = None,
    logger: logging.Logger | None = None,
) -> Any:
    """:func:`build_sampler` / :func:`build_draft` / :func:`build_attention` / :func:`build_filter`
    by ``part``; ``spec=None`` (the framework's own path) stays ``None``."""
    where = where or f"{part}_kwargs"
    if spec is None:
        _no_kwargs(part, kwargs, where)
        if draft is not None:
            raise GRPOPartsError("draft: only used with a sampler given by name (e.g. sampler='speculative')")
        return None
    if part == "sampler":
        return build_sampler(spec, policy, draft=draft, kwargs=kwargs, where=where)
    if part == "draft":
        return build_draft(spec, policy, kwargs=kwargs, where=where)
    if part == "attention":
        return build_attention(spec, policy, kwargs=kwargs, where=where, logger=logger)
    if part == "filter":
        return build_filter(spec, kwargs=kwargs, where=where)
    raise GRPOPartsError(f"part: expected one of {list(PART_KINDS)}, got {part!r}")
