"""grpo_parts.tiny_vision: every family builds offline, and its images (and the Qwen family's videos)
carry as many placeholder tokens as the model makes features (a forward accepts them)."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.attention.vision import row_positions
from grpo_parts.tiny_vision import VLM_FAMILIES, tiny_image, tiny_video, tiny_vlm, vlm_family_missing


@pytest.mark.parametrize("family", sorted(VLM_FAMILIES))
def test_images_fit_the_model(family: str) -> None:
    if vlm_family_missing(family):
        pytest.skip(vlm_family_missing(family))
    model = tiny_vlm(family, vocab_size=32)
    gen = torch.Generator().manual_seed(0)
    parts = [tiny_image(model, size, gen) for size in (1, 2)]
    if family.startswith("qwen"):
        parts.append(tiny_video(model, 2, gen))
    ids = torch.tensor([[5] + [t for tokens, _ in parts for t in tokens] + [6]])
    inputs = {k: torch.cat([p[k] for _, p in parts if k in p]) for _, p in parts for k in p}
    if family == "gemma3":  # its image attention needs token_type_ids (grpo_parts refuses it)
        inputs["token_type_ids"] = (ids == model.config.image_token_id).long()
    pos, _ = row_positions(model, ids, torch.ones_like(ids), inputs)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, **inputs).logits
    assert logits.shape[:2] == ids.shape and bool(torch.isfinite(logits).all())


def test_unknown_family_names_the_choices() -> None:
    with pytest.raises(ValueError, match="family: expected one of"):
        tiny_vlm("nope")
