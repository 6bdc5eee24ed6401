"""The shared-prefix forward and its one-token probe: the model run on the grouped grid with this
package's attention function selected, and the check that every decoder layer received the layout.

:mod:`.run` calls :func:`grouped_forward` once per model call of a :class:`~.plan.Plan`; the
backend's capability check (:meth:`~.backend.SharedPrefixAttention.not_supported_reasons`) runs the
probe.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ...compat import register_attention_function, select_attention
from ...errors import GRPOPartsError, NotSupportedError
from ...wrappers import inner_model, ranks_of, sharding
from ..protocol import LogprobBatch
from .guard import layout_shortfall, model_kind
from .layout import LAYOUT_KWARG, GroupedInputs, LayoutSettings, build_grouped_inputs

#: name under which the attention function is registered with transformers
KERNEL_NAME = "grpo_shared_prefix"


def register_attention() -> str:
    """Register the attention function with transformers under :data:`KERNEL_NAME`, with the mask
    builder of the model's own implementation for forwards without the layout (``mask="own"``:
    the shared-prefix forward passes a 4-D placeholder mask, which no builder touches). Idempotent."""
    from .kernels import shared_prefix_attention

    register_attention_function(KERNEL_NAME, shared_prefix_attention, mask="own")
    return KERNEL_NAME


def _use_kernel(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Select the shared-prefix attention function on ``model`` for the duration of a forward."""
    return select_attention(model, KERNEL_NAME)


#: model -> reasons found by the one-token probe (``[]``: every decoder layer got the layout)
_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, list[str]] = weakref.WeakKeyDictionary()


def grouped_forward(model: torch.nn.Module, grouped: GroupedInputs) -> torch.Tensor:
    """``model`` on the grid with the shared-prefix kernel selected; the logits at ``grouped.keep``.
    Raises :class:`NotSupportedError` when a decoder layer did not receive the layout."""
    b = grouped.input_ids.shape[0]
    placeholder = torch.ones(b, 1, 1, 1, dtype=torch.bool, device=grouped.input_ids.device)
    try:
        with _use_kernel(model):
            out = model(
                input_ids=grouped.input_ids,
                position_ids=grouped.position_ids,
                attention_mask=placeholder,  # 4-D: transformers passes it through instead of building a mask
                logits_to_keep=grouped.keep,
                use_cache=False,
                **{LAYOUT_KWARG: grouped.layout},
            )
    except (GRPOPartsError, torch.OutOfMemoryError):
        raise  # our own refusals name their cause already; running out of memory is not the architecture
    except Exception as e:  # noqa: BLE001 - whatever the layout breaks inside a model is a refusal
        raise NotSupportedError(
            "shared_prefix",
            [f"model: {model_kind(model)} failed under the shared-prefix layout: {type(e).__name__}: {e}"],
        ) from e
    shortfall = layout_shortfall(model, grouped.layout.receipts)
    if shortfall:
        raise NotSupportedError("shared_prefix", shortfall)
    return out.logits


def _sharded(model: torch.nn.Module) -> bool:
    """Whether a forward needs other processes (ZeRO-3 / FSDP / a process group) or has no weights
    here (meta): then the probe is left to the first real forward, which every rank runs."""
    if ranks_of() > 1 or sharding(model) is not None:
        return True
    return any(p.device.type == "meta" for p in model.parameters())


def probe_reasons(model: torch.nn.Module) -> list[str]:
    """Run ``model`` once on a one-token prompt and a one-token completion through the shared-prefix
    kernel (``eager``, no grad, eval mode; the modules' training flags are restored) and return why
    the layout did not reach every decoder layer (empty: it did). Cached per model; skipped (``[]``)
    for a model sharded across processes, where the first real forward checks the same."""
    key = inner_model(model)  # (``model`` may be a fresh CallsThrough view of it)
    if key in _PROBED:
        return _PROBED[key]
    if _sharded(model):
        return []
    register_attention()
    p = next(model.parameters())
    tok = torch.ones(1, 1, dtype=torch.long, device=p.device)
    batch = LogprobBatch(tok, tok, tok, tok, torch.zeros(1, dtype=torch.long, device=p.device))
    grouped = build_grouped_inputs(batch, LayoutSettings(kernel="eager"))
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            grouped_forward(model, grouped)
        reasons: list[str] = []
    except GRPOPartsError as e:  # NotSupportedError included: grouped_forward names the cause
        reasons = getattr(e, "reasons", None) or [f"model: {model_kind(model)}: {e}"]
    finally:
        for m, t in flags:
            m.training = t
    _PROBED[key] = reasons
    return reasons
