"""Reference sampler: exact identity with transformers ``generate`` under greedy decoding, and the
right sampling distribution (chi-square goodness of fit against an enumerated exact distribution)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.testing import chi_square_gof, encode_sequences, processed_probs, sequence_distribution
from grpo_parts.tiny import tiny_causal_lm
from grpo_parts.tiny_vision import tiny_image, tiny_video, tiny_vlm, vlm_family_missing
from grpo_parts.types import VisionInputs

P_MIN = 1e-3  # derandomized seeds: a correct sampler passes deterministically; a wrong one gives p ~ 0


@pytest.fixture(scope="module")
def lm() -> torch.nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, seed=1)


@pytest.fixture(scope="module")
def small_vocab_lm() -> torch.nn.Module:
    # Larger init scale so the next-token distributions are far from uniform (a sharper test).
    return tiny_causal_lm(
        "llama", vocab_size=12, hidden_size=32, num_layers=2, num_heads=4, seed=3, initializer_range=0.2
    )


PROMPTS = [[5, 17, 3, 44, 9, 21, 60], [7, 8], [90, 1, 2, 3], [33]]


def _generate_hf(model, prompts: PromptBatch, max_new_tokens: int, eos: list[int] | None):
    out = model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[:, prompts.input_ids.shape[1] :]


def test_greedy_matches_generate_without_eos(lm):
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    ro = ReferenceSampler(lm).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    want = _generate_hf(lm, prompts, 12, None)
    assert ro.completion_ids.shape == (4, 12)  # max_new_tokens respected, exactly
    assert torch.equal(ro.completion_ids, want)
    assert bool(ro.completion_mask.bool().all())


def test_greedy_matches_generate_with_eos_at_different_steps(lm):
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    free = _generate_hf(lm, prompts, 12, None)
    # Pick EOS tokens that the greedy continuations actually emit, so rows stop at different steps.
    eos = sorted({int(free[0, 2]), int(free[2, 5])})
    ro = ReferenceSampler(lm).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, eos_token_ids=eos)
    )
    want = _generate_hf(lm, prompts, 12, eos)
    lengths = ro.completion_lengths().tolist()
    assert len(set(lengths)) > 1, lengths
    assert ro.completion_ids.shape[1] <= 12
    t = max(ro.completion_ids.shape[1], want.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, t - x.shape[1]), value=0)  # noqa: E731
    assert torch.equal(pad(ro.completion_ids), pad(want))
    for row, n in enumerate(lengths):  # each row stops right after its first EOS
        assert int(ro.completion_ids[row, n - 1]) in eos or n == 12
        assert not any(int(x) in eos for x in ro.completion_ids[row, : n - 1])


def _plain_logprobs(model, ro, temperature: float) -> torch.Tensor:
    """Per-token log-probs of the emitted tokens from one plain forward (no cache)."""
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    mask = torch.cat([ro.prompt_mask.long(), ro.completion_mask.long()], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    t = ro.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -t - 1 : -1]
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, ro.completion_ids[..., None])[..., 0]
    return lp.masked_fill(ro.completion_mask == 0, 0.0)


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.0, 1.0, 0)]
)
def test_logprobs_equal_plain_forward(lm, temperature, top_p, top_k):
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        group_size=3,
        max_new_tokens=9,
        eos_token_ids=(4, 11),
    )
    ro = ReferenceSampler(lm).generate(prompts, params, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _plain_logprobs(lm, ro, params.logprob_temperature)
    torch.testing.assert_close(ro.logprobs, want, atol=1e-5, rtol=0)
    assert ro.group_index.tolist() == [b for b in range(4) for _ in range(3)]
    assert torch.equal(ro.prompt_ids[::3], prompts.input_ids)


def test_seed_determinism(lm):
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=4, max_new_tokens=10)
    s = ReferenceSampler(lm)
    a = s.generate(prompts, params, torch.Generator().manual_seed(7))
    b = s.generate(prompts, params, torch.Generator().manual_seed(7))
    c = s.generate(prompts, params, torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


# ----------------------------------------------------------------------------- distribution tests

N_SAMPLES = 4000


def _sample_codes(model, prompt, length, params_kw, seed):
    prompts = PromptBatch.from_lists([prompt], pad_token_id=0)
    params = SamplingParams(group_size=N_SAMPLES, max_new_tokens=length, **params_kw)
    ro = ReferenceSampler(model).generate(prompts, params, torch.Generator().manual_seed(seed))
    assert ro.completion_ids.shape == (N_SAMPLES, length)
    return ro.completion_ids


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=3),
    ],
    ids=["t1", "t0.7-top_p0.9", "top_k3"],
)
def test_sampling_distribution_chi_square(small_vocab_lm, kw):
    vocab = 12
    prompt = [3, 1, 4, 1, 5]
    toks = _sample_codes(small_vocab_lm, prompt, 3, kw, seed=11)
    # first position against the model's (processed) softmax from a plain forward
    with torch.no_grad():
        logits = small_vocab_lm(input_ids=torch.tensor([prompt])).logits[0, -1]
    p1 = processed_probs(logits, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))
    assert chi_square_gof(toks[:, 0], p1) > P_MIN
    # 2- and 3-token sequences against the enumerated exact distribution
    for length in (2, 3):
        probs = sequence_distribution(small_vocab_lm, prompt, length, **kw)
        assert chi_square_gof(encode_sequences(toks[:, :length], vocab), probs) > P_MIN


def test_chi_square_detects_a_wrong_distribution(small_vocab_lm):
    """The test has power: samples at temperature 1 fail against the temperature-0.7 distribution."""
    prompt = [3, 1, 4, 1, 5]
    toks = _sample_codes(small_vocab_lm, prompt, 2, dict(temperature=1.0), seed=12)
    wrong = sequence_distribution(small_vocab_lm, prompt, 2, temperature=0.7)
    assert chi_square_gof(encode_sequences(toks, 12), wrong) < 1e-6
    # and a token outside top-k is an immediate failure
    p = np.full(12, 1 / 11)
    p[0] = 0.0
    assert chi_square_gof(np.array([0, 1, 2]), p) == 0.0


def test_temperature_1_first_token_matches_softmax_with_left_padding(small_vocab_lm):
    """Several prompts of different lengths in one batch (left padding) each sample from their own softmax."""
    prompts_l = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [11, 0, 7, 7]]
    prompts = PromptBatch.from_lists(prompts_l, pad_token_id=0)
    ro = ReferenceSampler(small_vocab_lm).generate(
        prompts, SamplingParams(group_size=1500, max_new_tokens=1), torch.Generator().manual_seed(5)
    )
    for b, prompt in enumerate(prompts_l):
        with torch.no_grad():
            logits = small_vocab_lm(input_ids=torch.tensor([prompt])).logits[0, -1]
        rows = ro.group_index == b
        assert chi_square_gof(ro.completion_ids[rows, 0], processed_probs(logits)) > P_MIN


@pytest.mark.parametrize("kind", ["reference", "speculative"])
def test_decoding_runs_with_the_collector_paused(lm: torch.nn.Module, kind: str) -> None:
    """Both samplers decode with Python's cyclic collector off (a full collection inside a step cost
    up to 0.68 s in the main job and was timed as the step's cost), and turn it back on after --
    or leave it off where the caller had it off."""
    import gc

    from grpo_parts.draft.ngram import NGramDraft
    from grpo_parts.sampler.speculative.config import SpeculativeConfig
    from grpo_parts.sampler.speculative.sampler import SpeculativeSampler

    seen: list[bool] = []
    handle = lm.register_forward_hook(lambda *_: seen.append(gc.isenabled()))
    sampler = (
        ReferenceSampler(lm)
        if kind == "reference"
        else SpeculativeSampler(lm, NGramDraft(), SpeculativeConfig(draft_tokens=2))
    )
    prompts = PromptBatch.from_lists(PROMPTS[:2], pad_token_id=0)
    params = SamplingParams(max_new_tokens=4, group_size=2)
    try:
        assert gc.isenabled()
        sampler.generate(prompts, params, torch.Generator().manual_seed(0))
        assert seen and not any(seen)
        assert gc.isenabled()
        gc.disable()
        sampler.generate(prompts, params, torch.Generator().manual_seed(0))
        assert not gc.isenabled()
    finally:
        gc.enable()
        handle.remove()


# ------------------------------------------------------------------ image prompts (a VLM policy)


def _image_prompts(model: torch.nn.Module, images_per_prompt: list[int], seed: int) -> PromptBatch:
    gen = torch.Generator().manual_seed(seed)
    rows, per_prompt = [], []
    for n in images_per_prompt:
        ids, parts = [5], []
        for size in range(1, n + 1):
            tokens, inputs = tiny_image(model, size, gen)
            ids += tokens + [6]
            parts.append(inputs)
        rows.append(ids)
        per_prompt.append({k: torch.cat([p[k] for p in parts]) for k in (parts[0] if parts else {})})
    batch = PromptBatch.from_lists(rows, pad_token_id=0)
    return PromptBatch(batch.input_ids, batch.attention_mask, VisionInputs(tuple(per_prompt)))


def _peaked_vlm(family: str) -> Any:
    model = tiny_vlm(family, vocab_size=16, seed=3)
    head = torch.nn.Linear(model.lm_head.in_features, 16, bias=True)
    with torch.no_grad():  # a peaked next-token law, so that the image changes it visibly ...
        head.weight.copy_(model.lm_head.weight * 8.0)
        head.bias.zero_()
        head.bias[-4:] = -1e4  # ... that never emits the image tokens (tiny_vision reserves the last 4)
    model.lm_head = head
    return model


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_image_prompts_greedy_equals_full_forwards(family: str) -> None:
    model = _peaked_vlm(family)
    prompts = _image_prompts(model, [1, 2, 0], seed=0)
    params = SamplingParams(group_size=2, max_new_tokens=4, temperature=0.0)
    out = ReferenceSampler(model).generate(prompts, params)
    assert out.vision is prompts.vision
    for b in range(prompts.num_prompts):  # greedy by full forwards of the prompt alone, no cache
        ids = prompts.input_ids[b][prompts.attention_mask[b].bool()].tolist()
        images = prompts.vision.per_prompt[b]  # type: ignore[union-attr]
        want = []
        for _ in range(4):
            probs = sequence_distribution(model, ids + want, 1, temperature=0.0, images=images)
            want.append(int(np.argmax(probs)))
        for row in (2 * b, 2 * b + 1):
            assert out.completion_ids[row].tolist() == want


def test_image_prompts_sampling_law_chi_square() -> None:
    model = _peaked_vlm("qwen2_vl")
    prompts = _image_prompts(model, [1, 2], seed=1)
    n = 1500
    out = ReferenceSampler(model).generate(
        prompts,
        SamplingParams(group_size=n, max_new_tokens=2, temperature=1.0),
        torch.Generator().manual_seed(5),
    )
    for b in range(2):
        ids = prompts.input_ids[b][prompts.attention_mask[b].bool()].tolist()
        images = prompts.vision.per_prompt[b]  # type: ignore[union-attr]
        codes = encode_sequences(out.completion_ids[b * n : (b + 1) * n, :2], 16)
        # each row samples its own prompt's law, with its own images
        assert chi_square_gof(codes, sequence_distribution(model, ids, 2, images=images)) > P_MIN
        # the test has power: the same prompt's law at another temperature is rejected
        wrong = sequence_distribution(model, ids, 2, temperature=0.5, images=images)
        assert chi_square_gof(codes, wrong) < 1e-6


def test_image_prompts_never_sample_a_placeholder_token() -> None:
    model = tiny_vlm("qwen2_vl", vocab_size=16, seed=3)
    image_token = int(model.config.image_token_id)
    head = torch.nn.Linear(model.lm_head.in_features, 16, bias=True)
    with torch.no_grad():  # a policy that all but insists on the image token: logit 5, the rest 0
        head.weight.zero_()
        head.bias.zero_()
        head.bias[image_token] = 5.0
    model.lm_head = head
    prompts = _image_prompts(model, [1, 2], seed=2)
    out = ReferenceSampler(model).generate(
        prompts, SamplingParams(group_size=50, max_new_tokens=3, temperature=1.0)
    )
    assert not bool((out.completion_ids == image_token).any())
    # the log-probs recorded stay the policy's own, what the training forward computes
    own = -math.log(15 + math.exp(5.0))
    torch.testing.assert_close(out.logprobs, torch.full_like(out.logprobs, own))


@pytest.mark.parametrize(
    "family", [f for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") if vlm_family_missing(f) is None]
)
def test_video_prompts_greedy_equals_full_forwards(family: str) -> None:
    # the text after a video continues where the model's own positions put it (Qwen2.5-VL: below
    # the frames' temporal positions), in decoding as in the full forward
    model = _peaked_vlm(family)
    tokens, video = tiny_video(model, 2, torch.Generator().manual_seed(0))
    ids = [5, *tokens]
    text = PromptBatch.from_lists([ids, [5, 6]], pad_token_id=0)
    prompts = PromptBatch(text.input_ids, text.attention_mask, VisionInputs((video, {})))
    out = ReferenceSampler(model).generate(
        prompts, SamplingParams(group_size=1, max_new_tokens=4, temperature=0.0)
    )
    want: list[int] = []
    for _ in range(4):
        want.append(
            int(np.argmax(sequence_distribution(model, ids + want, 1, temperature=0.0, images=video)))
        )
    assert out.completion_ids[0].tolist() == want
