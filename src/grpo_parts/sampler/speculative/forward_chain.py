"""What a policy's instance-replaced ``forward`` does around its class's own forward.

Trainers wrap ``model.forward`` on the instance with layers that change only the numeric context
of a decode forward: accelerate's mixed-precision ``convert_outputs_to_fp32(autocast(forward))`` and
TRL's fused LM head (a no-op unless ``fused_lm_head=True``). The lean forward calls the weights, not
the forward, so :func:`forward_chain` walks that chain and returns the :class:`ForwardChain` to apply,
or why it cannot. Layers are recognised by module and qualified name: neither accelerate nor TRL is
imported here.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import torch

#: the wrappers' code: (file path ending, function name); matched on the code object, because
#: ``functools.wraps`` gives the autocast decorator and TRL's head the wrapped forward's names
_ACCELERATE_FP32 = (("accelerate", "utils", "operations.py"), "forward")
_TORCH_AUTOCAST = (("torch", "amp", "autocast_mode.py"), "decorate_autocast")
_TRL_FUSED_HEAD = (("trl", "trainer", "utils.py"), "_fused_forward")
#: accelerate's output-converting class, by module and name (its instances copy the wrapped names)
_ACCELERATE_FP32_CLASS = ("accelerate.utils.operations", "ConvertOutputsToFp32")
#: half-precision dtypes accelerate's ``convert_to_fp32`` converts
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ForwardChain:
    """The numeric context of a model's forward: ``autocasts`` (``torch.autocast`` instances,
    outermost first) entered around it and whether half-precision outputs come back as float32."""

    autocasts: tuple[Any, ...] = ()
    to_fp32: bool = False

    @property
    def plain(self) -> bool:
        """Nothing to apply: the class's forward as it is."""
        return not self.autocasts and not self.to_fp32

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The autocast instances the wrappers enter, entered in the same order. The instances
        themselves, as the wrappers re-enter them on every call (their settings, exactly)."""
        with contextlib.ExitStack() as stack:
            for ac in self.autocasts:
                stack.enter_context(ac)
            yield

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the wrapped forward returns it (half precision converted to float32)."""
        return t.float() if self.to_fp32 and t.dtype in _HALF else t


def _code_is(fn: Any, what: tuple[tuple[str, ...], str]) -> bool:
    """``fn`` is a plain function whose code is ``what`` (file path ending, function name)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return False
    return code.co_name == what[1] and PurePath(code.co_filename).parts[-len(what[0]) :] == what[0]


def _closure(fn: Any) -> dict[str, Any]:
    """A function's free variables by name (empty when it has none)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def _step(fn: Any) -> tuple[Any, Any, bool] | None:
    """One recognised layer: ``(next callable, autocast or None, converts to fp32)``."""
    free = _closure(fn)
    if _code_is(fn, _ACCELERATE_FP32) and "model_forward" in free:  # accelerate's convert_outputs_to_fp32
        return free["model_forward"], None, True
    cls = type(fn)
    if (cls.__module__, cls.__qualname__) == _ACCELERATE_FP32_CLASS:
        return getattr(fn, "model_forward", None), None, True
    if _code_is(fn, _TORCH_AUTOCAST) and isinstance(free.get("autocast_instance"), torch.autocast):
        return free.get("func"), free["autocast_instance"], False
    if _code_is(fn, _TRL_FUSED_HEAD) and "original_forward" in free:
        # a pass-through unless called with fused_lm_head=True (the decode loop never is)
        return free["original_forward"], None, False
    return None


def forward_chain(model: torch.nn.Module) -> tuple[ForwardChain | None, str | None]:
    """``(chain, None)`` when ``model``'s forward is its class's own forward, possibly under the
    wrappers this module recognises; ``(None, why)`` otherwise."""
    fn: Any = model.__dict__.get("forward")
    cls_forward = type(model).forward
    autocasts: list[Any] = []
    to_fp32 = False
    for _ in range(16):
        if fn is None or fn is cls_forward:
            return ForwardChain(tuple(autocasts), to_fp32), None
        if isinstance(fn, types.MethodType):
            if fn.__self__ is not model:
                break
            fn = fn.__func__
            continue
        step = _step(fn)
        if step is None:
            break
        fn, ac, fp32 = step
        if ac is not None:
            autocasts.append(ac)
        to_fp32 = to_fp32 or fp32
    what = getattr(fn, "__qualname__", None) or type(fn).__name__
    return None, f"model: {type(model).__name__}.forward is replaced on the instance ({what})"
