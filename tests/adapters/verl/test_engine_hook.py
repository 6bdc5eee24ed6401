"""verl adapter: the ``forward_step`` dispatcher on verl-style nested micro-batches, without building
an FSDP engine: grpo_parts' log-probs feed verl's own ``ppo_loss`` and equal the plain packed forward
(float64), and each case that must run verl's own forward does so, counted, its reason logged once.
The real engine (train/infer, optimizer step, workers) is in test_engine_cpu.py."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from _cpu_verl import verl_on_cpu  # noqa: E402
from grpo_parts_adapters.verl import engine as hook  # noqa: E402
from grpo_parts_adapters.verl.config import ENGINE_ATTR, EngineOptions  # noqa: E402
from tensordict import NonTensorStack  # noqa: E402
from test_packed_attention import plain_packed_logprobs  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, FSDPEngineConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import (  # noqa: E402
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from grpo_parts.tiny import tiny_causal_lm  # noqa: E402

ROWS = [  # (uid, prompt, response): two groups, rows interleaved as after verl's balancing
    ("a", [5, 6, 7], [9, 10]),
    ("b", [11, 12], [13, 14, 15]),
    ("a", [5, 6, 7], [8]),
    ("b", [11, 12], [16]),
    ("a", [5, 6, 7], [20, 21, 22]),
]


def micro_batch(temperature=1.0, mm=None, **flags):
    nested = tu.nested_tensor_from_tensor_list
    g = torch.Generator().manual_seed(0)
    resp = [torch.tensor(r) for _, _, r in ROWS]
    td = tu.get_tensordict(
        {
            "input_ids": nested([torch.tensor(p + r) for _, p, r in ROWS]),
            "position_ids": nested([torch.arange(len(p) + len(r)) for _, p, r in ROWS]),
            "prompts": nested([torch.tensor(p) for _, p, _ in ROWS]),
            "responses": nested(resp),
            "response_mask": nested([torch.ones_like(x) for x in resp]),
            "old_log_probs": nested([-torch.rand(len(x), generator=g, dtype=torch.float64) for x in resp]),
            "advantages": nested([torch.randn(len(x), generator=g, dtype=torch.float64) for x in resp]),
            "uid": [u for u, _, _ in ROWS],
        },
        non_tensor_dict={
            "temperature": temperature,
            "calculate_entropy": True,
            "use_remove_padding": True,
            "dp_size": 1,
            "batch_num_tokens": sum(len(r) for _, _, r in ROWS),
            "global_batch_size": len(ROWS),
            **flags,
        },
    )
    # as verl's v1 agent loop stores it: one dict per sample, {} for text
    td["multi_modal_inputs"] = NonTensorStack(*[dict(x) for x in (mm or [{}] * len(ROWS))])
    return td


class StandInEngine(FSDPEngineWithLMHead):
    """The attributes ``forward_step`` reads, around a plain (unsharded) model."""

    def __init__(self, model, options: EngineOptions | None):
        self.module = model
        self.use_ulysses_sp = False
        self.ulysses_device_mesh = None
        self._autocast_dtype = torch.float32
        self.engine_config = FSDPEngineConfig(strategy="fsdp2")
        if options is not None:
            setattr(self.engine_config, ENGINE_ATTR, options)


class StandInCritic(StandInEngine, FSDPEngineWithValueHead):
    pass


@pytest.fixture(scope="module")
def cpu():
    with verl_on_cpu():
        yield


@pytest.fixture
def verl_forward(monkeypatch):
    """verl's own ``forward_step`` replaced by a spy (to see when the dispatcher hands over)."""
    calls = []

    def spy(self, micro_batch, loss_function, forward_only):
        calls.append(micro_batch)
        return torch.tensor(0.0), {"model_output": {}, "loss": 0.0, "metrics": {"verl": 1.0}}

    monkeypatch.setattr(FSDPEngineWithLMHead, "forward_step", spy)
    assert hook.install_engine_hook() and not hook.install_engine_hook()  # idempotent
    yield calls
    assert hook.uninstall_engine_hook()


@pytest.fixture(autouse=True)
def fresh_counters():
    hook.COUNTERS.flush("logprob")
    hook.COUNTERS.flush("train")
    hook._pending_logprob = False


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("qwen2", dtype=torch.float64, seed=2)


@pytest.mark.parametrize("backend", ["reference", "shared_prefix"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_dispatcher_feeds_verl_ppo_loss(cpu, verl_forward, model, backend, temperature):
    engine = StandInEngine(model, EngineOptions(attention=backend))
    mb = micro_batch(temperature)
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1)
    loss, out = engine.forward_step(mb, partial(ppo_loss, cfg), forward_only=False)
    assert not verl_forward  # empty multi_modal_inputs are text: grpo_parts ran
    lp = out["model_output"]["log_probs"]
    assert lp.is_nested and torch.equal(lp.offsets(), mb["input_ids"].offsets())
    assert "entropy" in out["model_output"]
    ids, cu = mb["input_ids"].values(), mb["input_ids"].offsets()
    ref = plain_packed_logprobs(model, ids, cu, temperature).detach()
    ours_resp = no_padding_2_padding(lp, mb)
    ref_resp = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(ref, cu), mb)
    torch.testing.assert_close(ours_resp, ref_resp, rtol=0, atol=1e-10)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    m = {k: v.aggregate() for k, v in out["metrics"].items() if k.startswith("parts/")}
    assert m["parts/attention/forwards"] == 1 and m["parts/attention/fallbacks"] == 0
    assert "actor/pg_loss" in out["metrics"]  # verl's loss metrics kept


FALLBACKS = {
    "distillation_use_topk": dict(distillation_use_topk=True),
    "calculate_sum_pi_squared": dict(calculate_sum_pi_squared=True),
    "per-sample temperatures": dict(temperature=torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0])),
}


def test_fallbacks_run_verls_forward_counted_and_logged_once(cpu, verl_forward, model, caplog):
    engine = StandInEngine(model, EngineOptions(attention="shared_prefix"))
    with caplog.at_level(logging.WARNING, logger=hook.logger.name):
        for reason, kw in FALLBACKS.items():
            for _ in range(2):
                _, out = engine.forward_step(micro_batch(**kw), None, forward_only=True)
                assert out["metrics"]["verl"] == 1.0  # verl's own output, plus the counters
                assert out["metrics"]["parts/attention/fallbacks"].aggregate() == 1
            assert sum(reason in r.getMessage() for r in caplog.records) == 1, reason
    assert len(verl_forward) == 2 * len(FALLBACKS)
    # the forward-only counts are reported with the next training micro-batch, once
    _, out = engine.forward_step(micro_batch(), None, forward_only=False)
    assert out["metrics"]["parts/attention/logprob_fallbacks"].aggregate() == 2 * len(FALLBACKS)
    _, out = engine.forward_step(micro_batch(), None, forward_only=False)
    assert "parts/attention/logprob_fallbacks" not in out["metrics"]


def test_grouped_layout_is_bounded_by_the_packed_micro_batch(cpu, verl_forward, model):
    """One call would pad both groups to 2 x (3 + 3 slots x 3) = 24 tokens, more than the 23 packed:
    the plan gives each group its own call (12 + 8 = 20); ``max_padding_ratio`` below that hands the
    micro-batch to verl's packed forward (counted)."""
    mb = micro_batch()
    packed = mb["input_ids"].values().numel()
    assert packed == 23
    default = StandInEngine(model, EngineOptions(attention="shared_prefix", layout="grid"))
    _, out = default.forward_step(mb, None, forward_only=True)
    m = {k: v.aggregate() for k, v in out["metrics"].items()}
    assert (
        not verl_forward
        and m["parts/attention/grid_tokens"] == 20
        and m["parts/attention/packed_tokens"] == packed
    )
    assert m["parts/attention/grid_over_packed_max"] <= 1 and m["parts/attention/padding_free_tokens"] <= 20
    tight = StandInEngine(
        model, EngineOptions(attention="shared_prefix", max_padding_ratio=0.8, layout="grid")
    )
    _, out = tight.forward_step(micro_batch(), None, forward_only=True)
    assert len(verl_forward) == 1 and out["metrics"]["parts/attention/grid_tokens"].aggregate() == 20
    assert out["metrics"]["parts/attention/fallbacks"].aggregate() == 1
    # the default layout ("auto"): one call, padding-free (each prompt once plus every response token)
    free = StandInEngine(model, EngineOptions(attention="shared_prefix"))
    _, out = free.forward_step(micro_batch(), None, forward_only=True)
    m = {k: v.aggregate() for k, v in out["metrics"].items()}
    assert m["parts/attention/grid_tokens"] == m["parts/attention/padding_free_tokens"] < 20
    assert m["parts/attention/grid_over_padding_free_max"] == 1.0
    assert len(verl_forward) == 1 and m["parts/attention/fallbacks"] == 0
    layers = model.config.num_hidden_layers  # the varlen cascade ran in every layer, counted
    assert (
        m["parts/attention/calls_varlen_cascade"] == layers and "parts/attention/calls_masked_sdpa" not in m
    )
    backend = free.__dict__["_grpo_parts_attention"][1]
    assert backend.last_plan["layout"] == "padding_free" and backend.layout_counts["padding_free"] == 1
    # varlen=false (the engine option, for A/B checks): the same padding-free call on the masked kernel
    masked = StandInEngine(
        model, EngineOptions(attention="shared_prefix", layout="padding_free", varlen=False)
    )
    _, out = masked.forward_step(micro_batch(), None, forward_only=True)
    m = {k: v.aggregate() for k, v in out["metrics"].items()}
    assert (
        m["parts/attention/calls_masked_sdpa"] == layers and "parts/attention/calls_varlen_cascade" not in m
    )


@pytest.mark.parametrize(
    ("kernel", "varlen", "expected"),
    [("sdpa", True, "padding_free"), ("eager", True, "padding_free"), ("eager", False, "grid")],
)
def test_the_backends_cost_choice_decides_the_padding_free_call(
    cpu, verl_forward, model, monkeypatch, kernel, varlen, expected
):
    """8 near-equal completions (20 and 21 tokens) after a 2-token prompt: padding-free saves 7 tokens,
    but under a dense span mask (``varlen=False``) it costs ~13x the grid's attention scores, so the
    backend (``layout_for``) keeps the grid and the plan follows it; the metrics say what ran, exactly."""
    g = torch.Generator().manual_seed(1)
    rows = [("a", [5, 6], torch.randint(3, 40, (20 + (i == 0),), generator=g).tolist()) for i in range(8)]
    monkeypatch.setitem(globals(), "ROWS", rows)
    options = EngineOptions(attention="shared_prefix", kernel=kernel, varlen=varlen)
    engine = StandInEngine(model, options)
    mb = micro_batch()
    _, out = engine.forward_step(mb, None, forward_only=True)
    m = {k: v.aggregate() for k, v in out["metrics"].items()}
    backend = engine.__dict__["_grpo_parts_attention"][1]
    assert backend.last_plan["layout"] == expected and not verl_forward
    assert m["parts/attention/padding_free_tokens"] == 2 + 8 * 20 + 1
    # the grid plan: the long row and the seven short ones as two sub-groups, (2 + 21) + (2 + 7 x 20)
    assert m["parts/attention/grid_tokens"] == (163 if expected == "padding_free" else 165)
    path = "varlen_cascade" if kernel == "sdpa" else "varlen_eager"
    assert ("parts/attention/calls_" + path in m) == (expected == "padding_free")
    ids, cu = mb["input_ids"].values(), mb["input_ids"].offsets()
    ref = plain_packed_logprobs(model, ids, cu, 1.0).detach()
    ours = no_padding_2_padding(out["model_output"]["log_probs"], mb)
    torch.testing.assert_close(
        ours, no_padding_2_padding(torch.nested.nested_tensor_from_jagged(ref, cu), mb), rtol=0, atol=1e-10
    )


def test_engines_without_options_and_critics_run_verls_forward_uncounted(cpu, verl_forward, model):
    before = hook.COUNTERS.total("attention") + hook.COUNTERS.total("attention", "fallbacks")
    for engine in (
        StandInEngine(model, None),
        StandInCritic(model, EngineOptions(attention="shared_prefix")),
    ):
        _, out = engine.forward_step(micro_batch(), None, forward_only=True)
        assert out["metrics"] == {"verl": 1.0}
    assert len(verl_forward) == 2
    assert hook.COUNTERS.total("attention") + hook.COUNTERS.total("attention", "fallbacks") == before


def test_image_micro_batches_are_served_with_each_rows_own_images(cpu, verl_forward):
    """verl's ``multi_modal_inputs`` (one dict per sample, as its data path stores a Qwen2-VL
    processor's outputs): grpo_parts scores each response with its own prompt's images, once per
    uid and image, equal to the model's own forward on each row with its images (float64); a uid
    with another image (same text) is its own group."""
    from grpo_parts.attention.vision import token_types
    from grpo_parts.tiny_vision import tiny_image, tiny_vlm

    vlm = tiny_vlm("qwen2_vl", dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    (img_a, kw_a), (img_b, kw_b) = tiny_image(vlm, 1, gen), tiny_image(vlm, 2, gen)
    _, kw_c = tiny_image(vlm, 1, gen)  # the size of a, other pixels
    prompts = {"a": ([5] + img_a + [6, 7], kw_a), "b": ([8] + img_b, kw_b), "c": ([5] + img_a + [6, 7], kw_c)}
    rows = [
        ("a", [9, 10]),
        ("b", [13, 14, 15]),
        ("a", [8]),
        ("c", [16, 17]),
        ("b", [16]),
        ("a", [20, 21, 22]),
    ]
    nested = tu.nested_tensor_from_tensor_list
    resp = [torch.tensor(r) for _, r in rows]
    full = [torch.tensor(prompts[u][0] + r) for u, r in rows]
    mb = tu.get_tensordict(
        {
            "input_ids": nested(full),
            "position_ids": nested([torch.arange(len(x)) for x in full]),
            "prompts": nested([torch.tensor(prompts[u][0]) for u, _ in rows]),
            "responses": nested(resp),
            "response_mask": nested([torch.ones_like(x) for x in resp]),
            "uid": [u for u, _ in rows],
        },
        non_tensor_dict={"temperature": 1.0, "calculate_entropy": False, "use_remove_padding": True},
    )
    mb["multi_modal_inputs"] = NonTensorStack(*[dict(prompts[u][1]) for u, _ in rows])
    ran, fell = hook.COUNTERS.total("attention"), hook.COUNTERS.total("attention", "fallbacks")
    for backend in ("shared_prefix", "reference"):
        engine = StandInEngine(vlm, EngineOptions(attention=backend))
        _, out = engine.forward_step(mb, None, forward_only=True)
        assert not verl_forward, backend  # served, not handed to verl's forward
        got = no_padding_2_padding(out["model_output"]["log_probs"], mb)
        for i, ((u, r), x) in enumerate(zip(rows, full)):
            with torch.no_grad():
                types = token_types(vlm, x[None])
                logits = vlm(input_ids=x[None], mm_token_type_ids=types, **prompts[u][1]).logits[0].double()
            want = logits.log_softmax(-1)[len(x) - len(r) - 1 : -1].gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(
                got[i, : len(r)], want, rtol=0, atol=1e-9, msg=lambda m, i=i: f"row {i}: {m}"
            )
    assert hook.COUNTERS.total("attention") - ran == 2  # both served, none fell back
    assert hook.COUNTERS.total("attention", "fallbacks") == fell
