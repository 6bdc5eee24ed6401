"""AttentionBackend in OpenRLHF's ``Actor.forward``: shared-prefix log-probs and gradients equal the
plain OpenRLHF actor's (float64, 1e-10), for padded and ``packing_samples`` actors."""

from __future__ import annotations

import pytest
import torch
from _openrlhf_helpers import KeepFloat64, openrlhf_batch, tiny_model
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from grpo_parts.attention import IMPLEMENTATIONS, get_attention_class

TOL = 1e-10


def shared_prefix_backend(**options):  # type: ignore[no-untyped-def]
    if "shared_prefix" not in IMPLEMENTATIONS:
        pytest.skip("the 'shared_prefix' AttentionBackend is not registered yet (grpo_parts.attention)")
    return get_attention_class("shared_prefix")(**options)


def plain_actor(model, temperature: float, packing: bool):
    from openrlhf.models import Actor

    actor = Actor(KeepFloat64(model), temperature=temperature)
    actor.packing_samples = packing  # OpenRLHF sets it only when it loads the model from a path
    return actor


def parts_actor(model, backend, temperature: float, packing: bool):
    from grpo_parts_adapters.openrlhf.actor import GRPOPartsActor

    actor = GRPOPartsActor(model, temperature=temperature)
    actor.packing_samples = packing
    return actor.use_backend(backend)


def logprobs_and_grads(actor, model, seq, att, am, weights):
    model.zero_grad(set_to_none=True)
    lp = actor(seq, am, attention_mask=att)
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


def assert_same(a, b, ga, gb, tol=TOL):
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(a, b, atol=tol, rtol=0)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(
            ga[name], gb[name], atol=tol, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}"
        )


CASES = dict(
    seed=st.integers(0, 10_000),
    group_size=st.integers(1, 4),
    num_prompts=st.integers(1, 3),
    family=st.sampled_from(["qwen2", "llama"]),
    temperature=st.sampled_from([1.0, 0.7]),
    packing=st.booleans(),
    env_tokens=st.booleans(),
    shuffle=st.booleans(),
)
NO_SHRINK = [
    Phase.explicit,
    Phase.reuse,
    Phase.generate,
]  # a failing case is reported as drawn (shrinking is slow)


def check_against_plain_actor(
    backend, seed, group_size, num_prompts, family, temperature, packing, env_tokens, shuffle
):
    gen = torch.Generator().manual_seed(seed)
    model = tiny_model(family, seed=seed % 7)
    model.train()
    seq, att, am = openrlhf_batch(gen, group_size, num_prompts, env_tokens=env_tokens, shuffle=shuffle)
    weights = torch.randn(am.shape, generator=gen, dtype=torch.float64)
    ref = logprobs_and_grads(plain_actor(model, temperature, packing), model, seq, att, am, weights)
    ours = logprobs_and_grads(parts_actor(model, backend, temperature, packing), model, seq, att, am, weights)
    assert_same(ours[0], ref[0], ours[1], ref[1])


@settings(max_examples=6, phases=NO_SHRINK)
@given(**CASES)
def test_shared_prefix_actor_matches_plain_actor(**case):
    check_against_plain_actor(shared_prefix_backend(), **case)


@settings(max_examples=4, phases=NO_SHRINK)
@given(**CASES)
def test_adapter_layout_with_reference_backend_matches_plain_actor(**case):
    """The adapter's own part (split at the first action, regroup, scatter back; the packed plain
    path) with the repeated-prefix backend: isolates adapter bugs from backend bugs."""
    from grpo_parts.attention.reference import RepeatedPrefixAttention

    check_against_plain_actor(RepeatedPrefixAttention(), **case)


def test_reference_backend_matches_unmodified_openrlhf_forward():
    """The layout mapping against OpenRLHF's forward exactly as shipped (float32 logits cast)."""
    from openrlhf.models import Actor

    from grpo_parts.attention.reference import RepeatedPrefixAttention

    gen = torch.Generator().manual_seed(3)
    model = tiny_model("qwen2")
    seq, att, am = openrlhf_batch(gen, 3, 2, env_tokens=True)
    plain = Actor(model, temperature=0.8)
    plain.packing_samples = False
    ours = parts_actor(model, RepeatedPrefixAttention(), 0.8, packing=False)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(seq, am, attention_mask=att).float(), plain(seq, am, attention_mask=att), atol=1e-5, rtol=0
        )


def test_entropy_output_matches_reference_backend():
    from grpo_parts.attention.reference import RepeatedPrefixAttention

    backend = shared_prefix_backend()
    gen = torch.Generator().manual_seed(5)
    model = tiny_model("qwen2")
    seq, att, am = openrlhf_batch(gen, 3, 2)
    outs = []
    for b in (RepeatedPrefixAttention(), backend):
        lp, out = parts_actor(model, b, 1.0, False)(
            seq, am, attention_mask=att, return_output=True, return_entropy=True
        )
        assert out.entropy.shape == (seq.shape[0], seq.shape[1] - 1)
        outs.append((lp, out.entropy[:, -am.shape[1] :] * am))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=TOL, rtol=0)


def test_unsupported_calls_fall_back_to_openrlhf_forward():
    from grpo_parts.attention.reference import RepeatedPrefixAttention

    gen = torch.Generator().manual_seed(1)
    model = tiny_model("qwen2")
    seq, att, am = openrlhf_batch(gen, 2, 1)
    actor = parts_actor(model, RepeatedPrefixAttention(), 1.0, False)
    with torch.no_grad():
        out = actor(seq, None, attention_mask=att, return_output=True)
        actor(seq, am, attention_mask=att)
    assert out["logits"].shape[:2] == seq.shape
    assert actor.counters.flush() == {"parts/attention/forwards": 1.0, "parts/attention/fallbacks": 1.0}
    assert actor.counters.reasons["attention"] == [
        "caller wants log-probs of every position (return_logprobs / no action_mask)"
    ]


def test_without_backend_it_is_openrlhfs_actor():
    """Built as the grpo_parts model actors build it, before a backend is given: OpenRLHF's forward."""
    from grpo_parts_adapters.openrlhf.actor import GRPOPartsActor
    from openrlhf.models import Actor

    gen = torch.Generator().manual_seed(2)
    model = tiny_model("qwen2")
    seq, att, am = openrlhf_batch(gen, 2, 2)
    ours, plain = GRPOPartsActor(model, temperature=0.9), Actor(model, temperature=0.9)
    for a in (ours, plain):
        a.packing_samples = False
    with torch.no_grad():
        torch.testing.assert_close(ours(seq, am, attention_mask=att), plain(seq, am, attention_mask=att))
    assert ours.counters.flush() == {}


class _Engine(torch.nn.Module):
    """Shaped like DeepSpeed's engine around the model (``.module``): counts its forwards."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_backend_calls_the_model_through_its_wrapper():
    """The backend inspects the transformers model but calls it through the wrapper the actor holds,
    as OpenRLHF's forward does: ``DeepSpeedEngine.forward`` sets up DeepSpeed's backward (under ZeRO-3,
    gradient accumulation across micro-batches; calling the inner module lost all but the last one)."""
    from grpo_parts.attention.reference import RepeatedPrefixAttention

    gen = torch.Generator().manual_seed(4)
    model = tiny_model("qwen2")
    seq, att, am = openrlhf_batch(gen, 3, 2, env_tokens=True)
    for backend in (RepeatedPrefixAttention(), shared_prefix_backend()):
        engine = _Engine(model)
        actor = parts_actor(engine, backend, 1.0, packing=False)
        weights = torch.randn(am.shape, generator=gen, dtype=torch.float64)
        a, ga = logprobs_and_grads(actor, model, seq, att, am, weights)
        assert engine.calls >= 1 and actor.counters.flush()["parts/attention/forwards"] == 1
        b, gb = logprobs_and_grads(parts_actor(model, backend, 1.0, False), model, seq, att, am, weights)
        assert_same(a, b, ga, gb)


def test_attach_refuses_unsupported_model():
    from grpo_parts.errors import NotSupportedError

    class Refuses:
        name = "refuses"

        def not_supported_reasons(self, model, batch=None):
            return ["model: not this one"]

    from grpo_parts_adapters.openrlhf.actor import GRPOPartsActor

    actor = GRPOPartsActor(tiny_model("qwen2"))
    with pytest.raises(NotSupportedError, match="not this one"):
        actor.use_backend(Refuses())
    assert actor.grpo_backend is None


def test_packed_long_tail_is_bounded_by_the_packed_tokens():
    """One prompt, 8 completions: one 40 tokens long, seven of 2. The group's layout would pad every
    slot to 40 (4 + 8 x 40 = 324 tokens vs 4 x 8 + 54 = 86 packed): the actor cuts the group into
    sub-groups by completion length (4 + 40 and 4 + 7 x 2 = 62 tokens), runs the part with no
    fallback, reports the tokens, and equals the plain actor."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 48, (4,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 48, (n,), generator=g).tolist() for n in [40] + [2] * 7]
    t = max(len(r) for r in rows)
    seq = torch.zeros(len(rows), t, dtype=torch.long)
    att = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        seq[i, : len(r)], att[i, : len(r)] = torch.tensor(r), 1
    am = torch.zeros(len(rows), t, dtype=torch.bool)
    am[:, 4:] = att[:, 4:].bool()
    am = am[:, 1:]
    model = tiny_model("qwen2", seed=0)
    plain = plain_actor(model, 1.0, packing=True)
    w = torch.randn(am.shape, generator=g, dtype=torch.float64)
    b, gb = logprobs_and_grads(plain, model, seq, att, am, w)
    # the grid layout: sub-groups by completion length; the default (auto): padding-free, 4 + 54
    for layout, grid_tokens in (("grid", (4 + 40) + (4 + 7 * 2)), ("auto", 4 + 54)):
        backend = shared_prefix_backend(layout=layout)
        ours = parts_actor(model, backend, 1.0, packing=True)
        a, ga = logprobs_and_grads(ours, model, seq, att, am, w)
        assert_same(a, b, ga, gb)
        assert ours.counters.flush() == {"parts/attention/forwards": 1.0, "parts/attention/fallbacks": 0.0}
        tokens = ours.flush_tokens()
        assert tokens["parts/attention/packed_tokens"] == 4 * 8 + 54
        assert tokens["parts/attention/grid_tokens"] == grid_tokens <= tokens["parts/attention/packed_tokens"]
        assert tokens["parts/attention/padding_free_tokens"] == 4 + 54
        varlen = model.config.num_hidden_layers if layout == "auto" else None  # counted, every layer
        assert tokens.get("parts/attention/calls_varlen_cascade") == varlen
        assert backend.last_plan["layout"] == ("grid" if layout == "grid" else "padding_free")


@pytest.mark.parametrize(
    ("kernel", "varlen", "expected"),
    [("sdpa", True, "padding_free"), ("eager", True, "padding_free"), ("eager", False, "grid")],
)
def test_the_backends_cost_choice_decides_the_padding_free_call(kernel, varlen, expected):
    """8 near-equal completions (one of 21 tokens, seven of 20) after a 2-token prompt: padding-free
    saves 7 tokens, but under a dense span mask (``varlen=False``) it costs far more attention scores
    than the grid's cascade, so the actor keeps the grid as the backend would (``layout_for``); exact
    either way."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 48, (2,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 48, (n,), generator=g).tolist() for n in [21] + [20] * 7]
    seq = torch.tensor([r + [0] * (23 - len(r)) for r in rows])
    att = (torch.arange(23) < torch.tensor([len(r) for r in rows])[:, None]).long()
    am = att[:, 1:].bool() & (torch.arange(1, 23) >= 2)
    model = tiny_model("qwen2", seed=0)
    w = torch.randn(am.shape, generator=g, dtype=torch.float64)
    b, gb = logprobs_and_grads(plain_actor(model, 1.0, packing=True), model, seq, att, am, w)
    backend = shared_prefix_backend(kernel=kernel, varlen=varlen)
    ours = parts_actor(model, backend, 1.0, packing=True)
    a, ga = logprobs_and_grads(ours, model, seq, att, am, w)
    assert_same(a, b, ga, gb)
    tokens = ours.flush_tokens()
    path = "varlen_cascade" if kernel == "sdpa" else "varlen_eager"
    assert (f"parts/attention/calls_{path}" in tokens) == (expected == "padding_free")
    assert backend.last_plan["layout"] == expected and tokens["parts/attention/padding_free_tokens"] == 163
    # the grid: the long row and the seven short ones as two sub-groups, (2 + 21) + (2 + 7 x 20)
    assert tokens["parts/attention/grid_tokens"] == (163 if expected == "padding_free" else 165)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_vision_language_rows_equal_openrlhfs_vlm_forward(family):
    """OpenRLHF merges its samples' images flat (``merge_mm_train_inputs``) before the actor's
    forward; the actor reads each row's share off its image tokens and the shared-prefix backend
    scores every row with its own images: log-probs and gradients equal OpenRLHF's own VLM forward
    (``is_vlm``: the model computes its positions), float64. Two prompts share a text, not an image."""
    from openrlhf.models import Actor

    from grpo_parts.attention.shared_prefix import SharedPrefixAttention
    from grpo_parts.tiny_vision import tiny_image, tiny_vlm, vlm_family_missing

    if vlm_family_missing(family):
        pytest.skip(vlm_family_missing(family))
    model = tiny_vlm(family, dtype=torch.float64)
    model.train()
    gen = torch.Generator().manual_seed(0)
    imgs = [tiny_image(model, 1, gen) for _ in range(2)]
    prompts = [[5, *imgs[0][0], 6], [5, *imgs[1][0], 6]]  # one text, two images
    rows = [(0, [9, 10]), (0, [11]), (1, [12, 13, 14]), (1, [15, 16])]
    width = max(len(prompts[p]) + len(c) for p, c in rows)
    seq = torch.zeros(len(rows), width, dtype=torch.long)
    att = torch.zeros_like(seq)
    am = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        toks = prompts[p] + c
        seq[i, width - len(toks) :] = torch.tensor(toks)  # left padding, as OpenRLHF's samples
        att[i, width - len(toks) :] = 1
        am[i, width - 1 - len(c) :] = True
    mm = {k: torch.cat([imgs[p][1][k] for p, _ in rows]) for k in imgs[0][1]}
    weights = torch.randn(am.shape, generator=gen, dtype=torch.float64)

    def run(actor):
        model.zero_grad(set_to_none=True)
        lp = actor(seq, am, attention_mask=att, **dict(mm))
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = Actor(KeepFloat64(model), temperature=1.0)
    plain.packing_samples, plain.is_vlm, plain._vlm_config = False, True, model.config
    ours = parts_actor(model, SharedPrefixAttention(), 1.0, False)
    ours.is_vlm, ours._vlm_config = True, model.config
    ref, got = run(plain), run(ours)
    assert ours.counters.flush() == {"parts/attention/forwards": 1.0, "parts/attention/fallbacks": 0.0}
    torch.testing.assert_close(got[0], ref[0], atol=1e-9, rtol=0)
    scale = max(float(g.abs().max()) for g in ref[1].values())
    assert ref[1].keys() == got[1].keys() and any("vision" in n or "visual" in n for n in ref[1])
    for n, g in ref[1].items():
        assert float((got[1][n] - g).abs().max()) <= 1e-6 * scale, n
