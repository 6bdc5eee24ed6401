"""Vision-language policies: the shared-prefix backend (each prompt and its images encoded once per
group, the vision tower run once per group) against the reference (each image repeated per
completion), float64, log-probs, entropies and gradients, vision tower included.

Hypothesis draws the family (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL with deepstack; plain
positions: LLaVA), images per prompt, image sizes, videos (the Qwen VL family, each processor's
layout), text around them, groups, padding, kernel and forced splits into several grids. Gemma 3 (bidirectional attention inside an image) is refused.
"""

from __future__ import annotations

import pytest
import torch
from _attention_helpers import exact_norms, logps_and_grads
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention
from grpo_parts.compat import transformers_version
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.tiny_vision import tiny_image, tiny_video, tiny_vlm, vlm_family_missing
from grpo_parts.types import VisionInputs

#: Qwen VL vision towers apply their rotary embedding in float32 (``q.float()``), so the vision
#: tower's gradients, summed over a group before that rounding in one path and after it in the
#: other, differ at ~1e-11 in a float64 model; a wrong layout is off by > 1e-3
ATOL = 1e-9
VOCAB = 48
EXACT = [f for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava") if vlm_family_missing(f) is None]


#: families refused below a transformers release: (release, what the refusal names)
REFUSED_BEFORE = {"qwen2_vl": ((5, 0), "no logits_to_keep argument")}


def refused_here(model: torch.nn.Module) -> str | None:
    """What the shared-prefix backend's refusal of ``model`` says under the installed transformers, or None."""
    before = REFUSED_BEFORE.get(model.config.model_type)  # type: ignore[union-attr]
    return before[1] if before is not None and transformers_version() < before[0] else None


def vlm(family: str, seed: int = 0) -> torch.nn.Module:
    # train mode: the vision tower's gradients are compared too (no dropout in these configs)
    return exact_norms(tiny_vlm(family, vocab_size=VOCAB, seed=seed, dtype=torch.float64)).train()


def image_batch(
    model: torch.nn.Module,
    gen: torch.Generator,
    prompts: list[list[int]],
    groups: list[int],
    max_completion: int,
) -> LogprobBatch:
    """``prompts[g]``: image sizes of prompt ``g`` (text between and around them), a negative entry
    a video of that many frames; ``groups[g]`` completions each; rows shuffled, prompts left-padded,
    completions right-padded."""

    def text(n: int) -> list[int]:  # ordinary tokens: never a special or image token
        return torch.randint(3, VOCAB - 4, (n,), generator=gen).tolist()

    ids, per_prompt = [], []
    for sizes in prompts:
        row, parts = text(int(torch.randint(1, 4, (1,), generator=gen))), []
        for size in sizes:
            tokens, inputs = tiny_image(model, size, gen) if size > 0 else tiny_video(model, -size, gen)
            row += tokens + text(int(torch.randint(0, 3, (1,), generator=gen)))
            parts.append(inputs)
        ids.append(row)
        per_prompt.append({k: torch.cat([p[k] for p in parts if k in p]) for p in parts for k in p})
    rows = [g for g, n in enumerate(groups) for _ in range(n)]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    p = max(map(len, ids))
    n = len(rows)
    prompt_ids, prompt_mask = torch.zeros(n, p, dtype=torch.long), torch.zeros(n, p, dtype=torch.long)
    completion_ids = torch.zeros(n, max_completion, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, g in enumerate(rows):
        prompt_ids[i, p - len(ids[g]) :] = torch.tensor(ids[g])
        prompt_mask[i, p - len(ids[g]) :] = 1
        c = int(torch.randint(1, max_completion + 1, (1,), generator=gen))
        completion_ids[i, :c] = torch.tensor(text(c))
        completion_mask[i, :c] = 1
    return LogprobBatch(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        torch.tensor(rows),
        VisionInputs(tuple(per_prompt)),
    )


def assert_same(model: torch.nn.Module, batch: LogprobBatch, backend: SharedPrefixAttention) -> None:
    why = refused_here(model)
    if why is not None:  # refused with its reason under this transformers (equivalent from the release on)
        with pytest.raises(NotSupportedError, match=why):
            backend.completion_logprobs(model, batch)
        return
    ref, ref_g = logps_and_grads(RepeatedPrefixAttention(), model, batch)
    out, out_g = logps_and_grads(backend, model, batch)
    assert backend.last_plan["layout"] == "grid"  # the shared-prefix forward ran (not a fallback)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropies, ref.entropies, atol=ATOL, rtol=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("visual" in n or "vision" in n for n in names)
    for name, a, b in zip(names, out_g, ref_g):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, name=name: f"grad of {name}: {m}")


@settings(max_examples=16, derandomize=True, deadline=None)
@given(
    family=st.sampled_from(EXACT),
    prompts=st.lists(st.lists(st.integers(1, 2), max_size=2), min_size=1, max_size=3),
    group_size=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    max_completion=st.integers(1, 4),
    kernel=st.sampled_from(["sdpa", "eager"]),
    split=st.booleans(),
    video=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_image_prompts_equal_the_reference(
    family: str,
    prompts: list[list[int]],
    group_size: list[int],
    max_completion: int,
    kernel: str,
    split: bool,
    video: int,
    seed: int,
) -> None:
    if video and family.startswith("qwen"):  # the Qwen VL family takes videos: the first prompt gets one
        prompts = [prompts[0] + [-video], *prompts[1:]]
    model = vlm(family, seed)
    batch = image_batch(
        model, torch.Generator().manual_seed(seed), prompts, group_size[: len(prompts)], max_completion
    )
    # split: one grid per group (a negative overhead forces it), each with its own prompts' images
    options = {"max_chunks": 8, "chunk_overhead_tokens": -1} if split else {}
    backend = SharedPrefixAttention(kernel, **options)  # type: ignore[arg-type]
    assert_same(model, batch, backend)
    if split and refused_here(model) is None:
        assert backend.last_plan["chunks"] == len(prompts)


def test_the_vision_tower_runs_once_per_group() -> None:
    model = vlm("qwen2_5_vl")
    batch = image_batch(model, torch.Generator().manual_seed(0), [[1], [2, 1]], [4, 3], 3)
    calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            SharedPrefixAttention("eager").completion_logprobs(model, batch)
            shared = list(calls)
            calls.clear()
            RepeatedPrefixAttention().completion_logprobs(model, batch)
    finally:
        hook.remove()
    per_prompt = [int(v["pixel_values"].shape[0]) for v in batch.vision.per_prompt]  # type: ignore[union-attr]
    assert shared == [sum(per_prompt)]  # each prompt's patches once
    assert calls == [4 * per_prompt[0] + 3 * per_prompt[1]]  # the reference: once per completion


def test_bidirectional_image_attention_is_refused() -> None:
    model = tiny_vlm("gemma3", vocab_size=VOCAB, dtype=torch.float64)
    batch = image_batch(model, torch.Generator().manual_seed(0), [[1]], [2], 2)
    for backend in (SharedPrefixAttention(), RepeatedPrefixAttention()):
        assert any("token_type_ids" in r for r in backend.not_supported_reasons(model, batch))
    with pytest.raises(NotSupportedError, match="attends both ways inside an image"):
        SharedPrefixAttention().completion_logprobs(model, batch)


def test_packed_rows_with_images_are_refused() -> None:
    model = vlm("llava")
    batch = image_batch(model, torch.Generator().manual_seed(0), [[1]], [2], 2)
    with pytest.raises(NotSupportedError, match="packed rows with images"):
        SharedPrefixAttention().plan(model, batch, packed=True)


def test_bad_vision_inputs_name_the_field() -> None:
    with pytest.raises(
        GRPOPartsError, match=r"VisionInputs.per_prompt\[0\]\['pixel_values'\]: expected a tensor"
    ):
        VisionInputs(({"pixel_values": [1, 2]},))  # type: ignore[dict-item]
    one = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(GRPOPartsError, match="LogprobBatch.group_index: expected values < 1"):
        LogprobBatch(one, one, one, one, torch.tensor([0, 1]), VisionInputs(({},)))


def test_a_completion_holding_an_image_token_is_refused() -> None:
    model = vlm("qwen2_vl")
    batch = image_batch(model, torch.Generator().manual_seed(0), [[1]], [2], 2)
    image_token = int(model.config.image_token_id)
    bad = LogprobBatch(
        batch.prompt_ids, batch.prompt_mask, batch.completion_ids.masked_fill(batch.completion_mask.bool(), image_token),
        batch.completion_mask, batch.group_index, batch.vision,
    )  # fmt: skip
    for backend in (SharedPrefixAttention(), RepeatedPrefixAttention()):
        reasons = backend.not_supported_reasons(model, bad)
        assert any(f"holds the image placeholder token {image_token}" in r for r in reasons), reasons


@pytest.mark.parametrize("family", [f for f in EXACT if f.startswith("qwen")])
def test_an_image_and_a_video_in_one_prompt(family: str) -> None:
    # Qwen2.5-VL spaces a video's frames in time: the text after it continues from its frame grid,
    # not from the largest position (vision.row_positions asks the model where text goes)
    model = vlm(family)
    batch = image_batch(model, torch.Generator().manual_seed(3), [[1, -2], [], [2]], [3, 2, 1], 3)
    assert_same(model, batch, SharedPrefixAttention("eager"))


def test_an_empty_call_runs_the_vision_tower() -> None:
    # ranks that make extra (empty) calls to match another rank's count run the tower in them too:
    # a sharded tower gathers its weights once per call on every rank
    from grpo_parts.attention.shared_prefix.chunking import empty_call_batch

    model = vlm("qwen2_5_vl")
    batch = image_batch(model, torch.Generator().manual_seed(0), [[1], [2]], [2, 2], 3)
    empty = empty_call_batch(batch)
    assert empty.vision is batch.vision and empty.completion_ids.shape == (1, 1)
    calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            SharedPrefixAttention("eager").completion_logprobs(model, empty)
    finally:
        hook.remove()
    assert len(calls) == 1
