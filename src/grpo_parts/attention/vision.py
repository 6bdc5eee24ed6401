"""What every attention backend needs to run a vision-language policy: the model keywords of a
batch's images and the position ids generation gives its tokens.

A VLM's completions are scored at the positions its sampler used: ``generate`` counts real tokens,
and the Qwen VL family (M-RoPE) gives image and video tokens 3-D positions from the model's own
``get_rope_index``, text after them where that function puts it. Both backends and the reference
sampler take their positions from :func:`row_positions`, so they agree with each other.
docs/attention.md, "Vision-language policies".
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..wrappers import inner_model, model_name, transformers_model

#: the processor keywords that carry a grid per image or video (the M-RoPE family reads them)
GRID_KEYS = ("image_grid_thw", "video_grid_thw")
#: config keys of the placeholder tokens a processor expands per image or video
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "image_token_index")


def is_vision_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language model (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def _rope_index_owner(model: torch.nn.Module) -> Any:
    """The module that defines ``get_rope_index`` (the ``...Model`` under ``...ForConditionalGeneration``), or None.
    Asked of the model under its wrappers: a :class:`~grpo_parts.wrappers.CallsThrough`'s own
    ``model`` attribute is the whole inner model, not its ``.model`` submodule."""
    inner = transformers_model(model)
    for m in (inner, getattr(inner, "model", None)):
        if m is not None and callable(getattr(m, "get_rope_index", None)):
            return m
    return None


def vision_reasons(model: torch.nn.Module) -> list[str]:
    """Why a VLM's image prompts cannot be scored here (empty: they can). Architectures whose image
    tokens attend to each other both ways (``token_type_ids``: Gemma 3, PaliGemma) are refused: both
    backends score completions causally, as this check's reference does."""
    if not is_vision_model(model):
        return []
    forward = inspect.signature(type(inner_model(model)).forward).parameters
    if "token_type_ids" in forward:
        return [
            f"model: {model_name(model)} attends both ways inside an image (token_type_ids), which the "
            "causal shared-prefix layout does not serve"
        ]
    return []


def placeholder_ids(model: torch.nn.Module) -> torch.Tensor:
    """The model's image and video placeholder token ids (``[K]``, possibly empty). A completion
    must not hold one: the forward that scores it with its prompt's images would take it for an
    image, so the samplers never emit them for image prompts."""
    cfg = model.config  # type: ignore[union-attr]
    ids = [getattr(cfg, k, None) for k in PLACEHOLDER_KEYS]
    return torch.tensor([int(i) for i in ids if i is not None], dtype=torch.long)


def placeholder_reasons(
    model: torch.nn.Module, completion_ids: torch.Tensor, mask: torch.Tensor
) -> list[str]:
    """Why completions ``completion_ids: [N, T]`` (real tokens where ``mask``) cannot be scored with
    their prompts' images: a row holding an image placeholder token (empty: none does)."""
    bad = torch.isin(completion_ids, placeholder_ids(model).to(completion_ids.device)) & mask.bool()
    if not bool(bad.any()):
        return []
    row, col = (int(x) for x in bad.nonzero()[0])
    return [
        f"LogprobBatch.completion_ids: row {row} holds the image placeholder token "
        f"{int(completion_ids[row, col])} at {col}, which the forward with images would take for an "
        "image; sample image prompts without placeholder tokens (the reference sampler does)"
    ]


def token_types(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids: [N, L]`` as a processor makes them: 1 on image tokens, 2 on video tokens."""
    cfg = model.config  # type: ignore[union-attr]
    out = torch.zeros_like(ids, dtype=torch.int32)
    for value, key in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(cfg, key, None)
        if token is not None:
            out = out.masked_fill(ids == token, value)
    return out


def row_positions(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, deltas)`` for rows ``ids: [N, L]`` (``mask``: real tokens, padding on either
    side) with their images ``inputs``: ``[3, N, L]`` from the model's ``get_rope_index`` where it has
    one and a grid is given (``deltas: [N, 1]``, what text after the rows adds to its 1-D position),
    else ``[N, L]`` counting real tokens (``deltas`` 0)."""
    owner = _rope_index_owner(model)
    text = (mask.long().cumsum(-1) - 1).clamp(min=0)
    zero = torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device)
    grids = {k: inputs[k] for k in GRID_KEYS if k in inputs}
    if owner is None or not grids:
        return text, zero
    # one text token appended after each row's real tokens: where the model puts text that follows
    # the row (a completion). Not "largest position + 1": Qwen2.5-VL spaces a video's frames in time,
    # and the text after it continues from the frame grid, below the frames' temporal positions.
    taken = set(placeholder_ids(model).tolist())
    text_id = next(t for t in range(len(taken) + 1) if t not in taken)
    ids1 = torch.cat([ids, torch.full_like(ids[:, :1], text_id)], dim=1)
    mask1 = torch.cat([mask.long(), torch.ones_like(mask[:, :1], dtype=torch.long)], dim=1)
    wanted = inspect.signature(owner.get_rope_index).parameters
    kw: dict[str, Any] = {"attention_mask": mask1, **grids}
    videos = grids.get("video_grid_thw")
    if "second_per_grid_ts" in wanted and videos is not None:
        # Qwen2.5-VL's processor gives each video's seconds per frame grid; its default when absent
        # runs out after sequence-length many videos: one second each, as that default means
        kw["second_per_grid_ts"] = inputs.get("second_per_grid_ts", torch.ones(videos.shape[0]))
    if "mm_token_type_ids" in wanted:
        kw["mm_token_type_ids"] = token_types(model, ids1)
    pos1, _ = owner.get_rope_index(ids1, **{k: v for k, v in kw.items() if k in wanted})
    after = pos1[0, :, -1] - mask.long().sum(-1)  # 1-D position of the next text token is the count
    return pos1[:, :, :-1], after.reshape(-1, 1).to(torch.long)


def image_batch_reasons(model: torch.nn.Module, batch: Any) -> list[str]:
    """Why a :class:`~grpo_parts.attention.protocol.LogprobBatch` with images cannot be scored on
    ``model`` (:func:`vision_reasons`, :func:`placeholder_reasons`); empty for a text batch."""
    if batch is None or batch.vision is None:
        return []
    return vision_reasons(model) + placeholder_reasons(model, batch.completion_ids, batch.completion_mask)
