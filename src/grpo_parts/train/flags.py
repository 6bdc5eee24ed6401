"""The ``grpo-parts train`` flags that name config fields: which field each sets, and the refusal of
contradictory ones (a flag and a ``--set`` of the same field with different values, ``--reference``
with parts, ``--compare``-only flags without it). Split from :mod:`.cli` so that file keeps the parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError

NO_DRAFT = "none"  # --draft none = parts.draft: null

#: flag dest -> dotted config key
FLAGS = {
    "steps": "steps",
    "seed": "seed",
    "group_size": "group_size",
    "lr": "lr",
    "name": "name",
    "out_dir": "out_dir",
    "model": "model",
    "data": "data",  # (--reward: "rewards", a list, in _flag_values)
    "eval_data": "eval_data",
    "device": "device",
    "sampler": "parts.sampler",
    "draft": "parts.draft",
    "attention": "parts.attention",
    "filter": "parts.filter",
    "target": "target_accuracy",
    "report_to": "report_to",
}

_MISSING = object()


def _flag_values(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Config key -> (the flag as given, its config value), for every config flag given."""
    out: dict[str, tuple[str, Any]] = {}
    for dest, key in FLAGS.items():
        given = getattr(args, dest, None)
        if given is None:
            continue
        value = None if dest == "draft" and given == NO_DRAFT else given
        if dest == "report_to":  # --report-to wandb tensorboard, or wandb,tensorboard
            value = [x for item in given for x in item.split(",") if x]
            given = " ".join(given)
        out[key] = (f"--{dest.replace('_', '-')} {given}", str(value) if isinstance(value, Path) else value)
    if getattr(args, "no_progress", False):
        out["progress"] = ("--no-progress", False)
    if getattr(args, "reward", None):
        out["rewards"] = (" ".join(f"--reward {r}" for r in args.reward), list(args.reward))
    return out


def _lookup(tree: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        if not isinstance(tree, dict) or k not in tree:
            return _MISSING
        tree = tree[k]
    return tree


def _agree(flag_value: Any, set_value: Any) -> bool:
    if set_value is _MISSING:
        return False
    if flag_value == set_value:
        return True
    if isinstance(flag_value, float) and isinstance(set_value, str):  # YAML reads 1e-4 as a string
        try:
            return float(set_value) == flag_value
        except ValueError:
            return False
    return isinstance(flag_value, str) and isinstance(set_value, str) and Path(flag_value) == Path(set_value)


def check_flags(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Refuse contradictory flags (one-line :class:`GRPOPartsError`); return :func:`_flag_values`."""
    from .config import parse_override

    flags = _flag_values(args)
    sets = [(item, *parse_override(item)) for item in args.sets]
    for item, key, value in sets:
        for fkey, (flag, fvalue) in flags.items():
            if fkey == key:
                theirs = value
            elif fkey.startswith(key + "."):
                theirs = _lookup(value, fkey[len(key) + 1 :])
            else:
                continue
            if not _agree(fvalue, theirs):
                whole = f", which replaces the whole {key!r} section" if fkey != key else ""
                raise GRPOPartsError(
                    f"{fkey}: set twice, by {flag} and by --set {item}{whole}; expected one of them, or the same value"
                )
    compare = getattr(args, "compare", False)
    if getattr(args, "reference", False):
        if compare:
            raise GRPOPartsError(
                "--reference: got it with --compare, which already runs the reference parts as one of its two "
                "runs; expected one of them"
            )
        clash = [flag for key, (flag, _) in flags.items() if key.startswith("parts.")]
        clash += [f"--set {item}" for item, key, _ in sets if key.split(".")[0] == "parts"]
        if clash:
            raise GRPOPartsError(
                f"--reference: sets every part to its reference, got it with {', '.join(clash)}; expected "
                "--reference alone, or the parts you want (e.g. --sampler reference)"
            )
    if not compare:
        for flag, given in (
            ("--json", getattr(args, "json", None) is not None),
            ("--seeds", getattr(args, "seeds", 1) != 1),
            ("--ablate", getattr(args, "ablate", False)),
        ):
            if given:
                raise GRPOPartsError(f"{flag}: only used with --compare, got it without")
    return flags
