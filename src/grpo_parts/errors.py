"""Input validation helpers: every error names the field, what it got and what it expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GRPOPartsError(ValueError):
    """Bad input to a grpo_parts function (a ``ValueError``, so callers can catch either)."""


class NotSupportedError(GRPOPartsError):
    """An implementation was asked to do something it declares it cannot do."""

    def __init__(self, impl: str, reasons: Sequence[str]):
        self.impl = impl
        self.reasons = list(reasons)
        super().__init__(f"{impl} cannot run here: " + "; ".join(self.reasons))


def install_hint(extra: str) -> str:
    """How to install the optional extra ``extra``, from a checkout and by package name."""
    return f"pip install -e '.[{extra}]' in a checkout, or pip install 'grpo-parts[{extra}]'"


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | str | None = None,
    allow_empty: bool = False,
) -> torch.Tensor:
    """``t``, validated: ``shape`` entries of ``None`` match any size; ``dtype`` is a dtype, a list of
    dtypes, or one of ``"float"``, ``"int"``, ``"bool_or_int"``."""
    if not isinstance(t, torch.Tensor):
        raise GRPOPartsError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise GRPOPartsError(f"{name}: expected a {ndim}-D tensor, got shape {_shape(t)}")
    if shape is not None:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        if t.ndim != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
            raise GRPOPartsError(f"{name}: expected shape {want}, got {_shape(t)}")
    if dtype is not None:
        ok: bool
        if dtype == "float":
            ok, want_dt = t.is_floating_point(), "a floating dtype"
        elif dtype == "int":
            ok = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
            want_dt = "an integer dtype"
        elif dtype == "bool_or_int":
            ok, want_dt = (not t.is_floating_point() and not t.is_complex()), "a bool or integer dtype"
        elif isinstance(dtype, torch.dtype):
            ok, want_dt = t.dtype == dtype, str(dtype)
        else:
            dts = list(dtype)  # type: ignore[arg-type]
            ok, want_dt = t.dtype in dts, " or ".join(str(d) for d in dts)
        if not ok:
            raise GRPOPartsError(f"{name}: expected {want_dt}, got {t.dtype}")
    if not allow_empty and t.numel() == 0:
        raise GRPOPartsError(f"{name}: expected a non-empty tensor, got shape {_shape(t)}")
    return t


def check_same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """All tensors must share the first tensor's shape."""
    ref = tensors[0]
    for n, t in zip(names[1:], tensors[1:]):
        if t.shape != ref.shape:
            raise GRPOPartsError(
                f"{n}: expected shape {_shape(ref)} (the shape of {names[0]}), got {_shape(t)}"
            )
