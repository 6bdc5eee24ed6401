"""Test-only stand-ins for OpenRLHF 0.11.2's top-level ``flash_attn`` / ``vllm`` imports (no CUDA).

Used by this package's ``conftest.py`` (for the test process) and by ``_cpu_openrlhf.py`` (for the
subprocess that runs OpenRLHF's DeepSpeed step); see the conftest's docstring.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import torch

STANDIN_NAMES = (
    "flash_attn",
    "flash_attn.bert_padding",
    "flash_attn.utils",
    "flash_attn.utils.distributed",
    "vllm",
    "vllm.inputs",
    "vllm.utils",
)


# ------------------------------------------------------------------ flash_attn.bert_padding in torch


def _rearrange(x: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    from einops import rearrange

    return rearrange(x, pattern, **sizes)


def _index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x[indices]


def _unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Any = None) -> tuple:
    lens = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu, int(lens.max()), lens


def _pad_input(hidden: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out = out.index_copy(0, indices, hidden)
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _all_gather(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("flash_attn stand-in: all_gather (ring attention) is not available on CPU")


# ------------------------------------------------------------------------------------------ vllm


class _SamplingParams:
    """vllm.SamplingParams stand-in: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.temperature, self.top_p, self.top_k = 1.0, 1.0, -1
        self.max_tokens, self.logprobs, self.n = 16, None, 1
        self.__dict__.update(kwargs)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    m.__dict__.update(attrs)
    return m


def _standins() -> dict[str, types.ModuleType]:
    return {
        "flash_attn": _module("flash_attn"),
        "flash_attn.bert_padding": _module(
            "flash_attn.bert_padding",
            index_first_axis=_index_first_axis,
            pad_input=_pad_input,
            rearrange=_rearrange,
            unpad_input=_unpad_input,
        ),
        "flash_attn.utils": _module("flash_attn.utils"),
        "flash_attn.utils.distributed": _module("flash_attn.utils.distributed", all_gather=_all_gather),
        "vllm": _module("vllm", SamplingParams=_SamplingParams),
        "vllm.inputs": _module("vllm.inputs", TokensPrompt=dict),
        "vllm.utils": _module("vllm.utils", random_uuid=lambda: "standin"),
    }


def _really_importable(name: str) -> bool:
    top = name.split(".")[0]
    if top in sys.modules and getattr(sys.modules[top], "__file__", None) is None:
        return False
    try:
        return importlib.util.find_spec(top) is not None
    except (ValueError, ImportError):
        return False


def install() -> dict[str, Any]:
    """Install the stand-ins whose real module does not import; returns what they replaced
    (``None`` = nothing) so :func:`uninstall` can put it back."""
    # Settle transformers' availability caches before any stand-in exists.
    import transformers.integrations.flash_attention  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    installed: dict[str, Any] = {}
    for name, mod in _standins().items():
        if _really_importable(name):
            continue
        installed[name] = sys.modules.get(name)
        sys.modules[name] = mod
    return installed


def uninstall(installed: dict[str, Any]) -> None:
    for name, previous in installed.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
