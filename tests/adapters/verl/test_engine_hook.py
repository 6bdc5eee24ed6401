"""verl adapter: the patched ``FSDPEngineWithLMHead.forward_step`` on a verl-style packed micro-batch
(nested tensors, non-tensor flags) feeds verl's own ``ppo_loss``; its log-probs equal the plain
packed forward and its gradients flow to the model."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from grpo_parts_adapters.verl import attention  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from grpo_parts.tiny import tiny_causal_lm  # noqa: E402


def plain_packed_logprobs(model, ids, cu, temperature):
    """verl's packed forward as flash-attn varlen computes it (same as in test_packed_attention.py):
    block-diagonal causal attention over one packed row, log-probs of the rolled labels."""
    nnz = ids.numel()
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    pos = torch.arange(nnz) - cu[:-1][seg]
    allowed = (seg[:, None] == seg[None, :]) & (torch.arange(nnz)[None, :] <= torch.arange(nnz)[:, None])
    mask = torch.zeros(1, 1, nnz, nnz, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask).logits[0]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.roll(ids, -1)[:, None]).squeeze(-1)


ROWS = [  # (uid, prompt, response): two groups, rows interleaved as after verl's balancing
    ("a", [5, 6, 7], [9, 10]),
    ("b", [11, 12], [13, 14, 15]),
    ("a", [5, 6, 7], [8]),
    ("b", [11, 12], [16]),
    ("a", [5, 6, 7], [20, 21, 22]),
]


def micro_batch(temperature: float):
    nested = tu.nested_tensor_from_tensor_list
    g = torch.Generator().manual_seed(0)
    resp = [torch.tensor(r) for _, _, r in ROWS]
    return tu.get_tensordict(
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
        },
    )


@pytest.fixture
def hook():
    assert attention.install_engine_hook("reference")
    yield
    assert attention.uninstall_engine_hook()


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_hooked_forward_step_feeds_verl_ppo_loss(hook, temperature):
    model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=2)
    engine = SimpleNamespace(
        module=model,
        use_ulysses_sp=False,
        _autocast_dtype=torch.float32,
        get_data_parallel_group=lambda: None,
    )
    mb = micro_batch(temperature)
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1)
    loss, out = FSDPEngineWithLMHead.forward_step(engine, mb, partial(ppo_loss, cfg), forward_only=False)
    lp = out["model_output"]["log_probs"]
    assert lp.is_nested and torch.equal(lp.offsets(), mb["input_ids"].offsets())
    assert "entropy" in out["model_output"]
    # verl's own response slicing of our log-probs == the plain packed forward's
    ids, cu = mb["input_ids"].values(), mb["input_ids"].offsets()
    ref = plain_packed_logprobs(model, ids, cu, temperature).detach()
    ours_resp = no_padding_2_padding(lp, mb)
    ref_resp = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(ref, cu), mb)
    torch.testing.assert_close(ours_resp, ref_resp, rtol=0, atol=1e-10)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_hook_is_off_without_a_backend(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    assert attention.install_engine_hook() is False
    assert not hasattr(FSDPEngineWithLMHead.forward_step, "_grpo_parts_original")
