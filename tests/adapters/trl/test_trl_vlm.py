"""GRPOPartsTrainer with a vision-language policy (issue 55): TRL's processor, an image dataset in
TRL's format (a conversational prompt with an image part, an ``image`` column), tiny Qwen2-VL and
LLaVA models. The attention backend scores TRL's rows with their own images exactly as TRL's forward
does, the reference sampler rolls image prompts out once per group, the filter keeps each kept
row's images, and every part counts its calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_parts.errors import NotSupportedError  # noqa: E402
from grpo_parts.tiny_vision import tiny_processor, tiny_vlm, vlm_family_missing  # noqa: E402

FAMILIES = [f for f in ("qwen2_vl", "llava") if vlm_family_missing(f) is None]


def _image(rng: Any, h: int, w: int) -> Any:
    import numpy as np
    from PIL import Image

    return Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))


def _dataset(n: int = 8) -> Any:
    """``n`` rows: one image each, of several sizes; rows 0 and 2 share a text and an image size
    (so their prompt tokens) with different images."""
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(0)
    texts = ["how many a", "what b c", "how many a", "d e f"]
    sizes = [(8, 8), (8, 12), (8, 8), (8, 16)]
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": texts[i % 4]}]}]
                for i in range(n)
            ],
            "image": [_image(rng, *sizes[i % 4]) for i in range(n)],
        }
    )


def _multi_image_dataset(n: int = 8) -> Any:
    """``n`` rows in TRL's ``images`` format: one or two images per prompt, of several sizes."""
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(1)
    counts = [1, 2, 2, 1]
    sizes = [(8, 8), (8, 12), (12, 8), (8, 16)]
    rows = []
    for i in range(n):
        k = counts[i % 4]
        content = [{"type": "image"}] * k + [{"type": "text", "text": ["how many a", "what b c"][i % 2]}]
        rows.append(
            ([{"role": "user", "content": content}], [_image(rng, *sizes[(i + j) % 4]) for j in range(k)])
        )
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "images": [r[1] for r in rows]})


def _reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL's conversational completions (``[{"role": "assistant", "content": ...}]``) scored as text."""
    return _tiny.reward([c[0]["content"] for c in completions])


def _trainer(family: str, cls: Any = GRPOPartsTrainer, steps: int = 1, data: Any = None, **parts: Any) -> Any:
    model = tiny_vlm(family, dtype=torch.float64)
    args = _tiny.config(
        per_device_train_batch_size=8, num_generations=4, max_steps=steps, gradient_accumulation_steps=2
    )
    return cls(
        model=model, reward_funcs=_reward, args=args, train_dataset=_dataset() if data is None else data,
        processing_class=tiny_processor(model), **parts,
    )  # fmt: skip


def _forward_inputs(tr: Any, multi: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, Any]]:
    """Eight rows as TRL scores them: four prompts with their images (``multi``: one or two each),
    two completions each (random text tokens), TRL's processor outputs and the completion mask
    right-padded."""
    ds = _multi_image_dataset(4) if multi else _dataset(4)
    proc = tr.processing_class
    rows = [i for i in range(4) for _ in range(2)]
    from trl.data_utils import apply_chat_template

    texts = [apply_chat_template({"prompt": ds[i]["prompt"]}, proc)["prompt"] for i in rows]
    images = [ds[i]["images"] if multi else [ds[i]["image"]] for i in rows]
    inputs = proc(images=images, text=texts, padding=True, return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    completion = torch.randint(3, 30, (len(rows), 5), generator=gen)
    cmask = torch.ones_like(completion)
    cmask[1, 3:] = 0
    ids = torch.cat([inputs["input_ids"], completion], dim=1)
    mask = torch.cat([inputs["attention_mask"], cmask], dim=1)
    mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in mm:
        mm["mm_token_type_ids"] = torch.cat([mm["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
    mm["num_images"] = [len(x) for x in images]
    return ids, mask, completion.shape[1], mm


def _scores(tr: Any, fn: Any, mm: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, keep: int) -> Any:
    """``(log-probs, {parameter: gradient})`` of one seam call under grad (TRL's chunking: 3 rows)."""
    tr.model.zero_grad()
    logps = fn(tr.model, ids, mask, keep, 3, **mm)[0]
    (logps * mask[:, -keep:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return logps.detach().double(), grads


@pytest.mark.parametrize(("family", "multi"), [(f, False) for f in FAMILIES] + [("qwen2_vl", True)])
def test_attention_equals_trls_forward_with_images(family: str, multi: bool) -> None:
    """On TRL's VLM rows (one image per prompt, or one or two) the shared-prefix backend's log-probs and every gradient (the vision
    tower's included) equal the reference backend's (each row with its images repeated) in float64,
    and TRL's own forward to float32 rounding (its fused LM head sums in float32)."""
    from grpo_parts.build import build_attention

    tr = _trainer(family, attention="shared_prefix")
    ids, mask, keep, mm = _forward_inputs(tr, multi)
    live = mask[:, -keep:].bool()
    parts = _scores(tr, tr._get_per_token_logps_and_entropies, mm, ids, mask, keep)
    assert tr._gp_counters.total("attention") >= 1 and tr._gp_counters.total("attention", "fallbacks") == 0
    tr.gp_attention = build_attention("reference", tr.model)
    ref = _scores(tr, tr._get_per_token_logps_and_entropies, mm, ids, mask, keep)
    trl = _scores(
        tr, lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(tr, *a, **k), mm, ids, mask, keep
    )
    assert any("visual" in n or "vision" in n for n in trl[1])  # the tower trains
    # gradients to a tolerance relative to each tensor's largest entry (or a thousandth of the
    # largest gradient, for near-zero ones such as a key bias's): with a group's rows summed
    # in another order, float64 gradients of this random tiny model differ by ~1e-7 of their size
    # (as TRL's own forward does between its eager and SDPA attention)
    for other, tol, gtol in ((ref, 1e-9, 1e-6), (trl, 1e-5, 1e-4)):
        torch.testing.assert_close(parts[0][live], other[0][live], rtol=tol, atol=tol)
        assert parts[1].keys() == other[1].keys()
        scale = max(float(g.abs().max()) for g in other[1].values())
        for n, g in other[1].items():
            err = float((parts[1][n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
            assert err <= gtol, (n, err)


@pytest.mark.parametrize(("family", "images"), [(f, "image") for f in FAMILIES] + [("qwen2_vl", "images")])
def test_every_part_serves_an_image_dataset(family: str, images: str, tmp_path: Path) -> None:
    """Reference sampler, shared-prefix attention, CPPO with a refill round, TRL's micro-batches
    regrouped by prompt: two steps on an image dataset (TRL's ``image`` column, or ``images`` with
    one or two per prompt), every part counted, nothing fell back."""
    tr = _trainer(
        family, steps=2, data=_multi_image_dataset() if images == "images" else None,
        sampler="reference", attention="shared_prefix",
        filter="cppo", filter_kwargs={"pruning_rate": 0.5}, parts={"refill_rounds": 1},
    )  # fmt: skip
    assert tr._gp_group_rows and not tr.parts_refused
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert logs
    for key in ("parts/sampler/rollouts", "parts/attention/forwards", "parts/filter/calls"):
        assert sum(h.get(key, 0) for h in logs) > 0, (key, logs)
    for part in ("sampler", "attention", "filter"):
        assert all(h.get(f"parts/{part}/fallbacks", 0) == 0 for h in logs), logs
    assert not tr._gp_counters.reasons


def test_a_sampler_without_image_prompts_is_refused_with_its_reason() -> None:
    """The speculative sampler does not roll out image prompts yet: refused in one line at set-up
    (strict), never run on text with the images dropped."""
    with pytest.raises(NotSupportedError, match="image prompts are rolled out by the reference sampler"):
        _trainer("qwen2_vl", sampler="speculative", draft="ngram")


def test_rows_with_one_text_and_different_images_are_different_groups() -> None:
    """TRL's rows with the same prompt tokens but different images never share a prompt encoding:
    two dataset rows share a text with different images, and the scores equal the reference's."""
    from grpo_parts.build import build_attention

    tr = _trainer("qwen2_vl", attention="shared_prefix")
    ids, mask, keep, mm = _forward_inputs(tr)
    same_text = [i for i in range(0, 8, 2) if torch.equal(ids[i, :-keep], ids[0, :-keep])]
    assert len(same_text) >= 2
    with torch.no_grad():
        a = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, keep, None, **mm)[0]
        tr.gp_attention = build_attention("reference", tr.model)
        b = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, keep, None, **mm)[0]
    live = mask[:, -keep:].bool()
    torch.testing.assert_close(a[live], b[live], rtol=1e-9, atol=1e-9)
