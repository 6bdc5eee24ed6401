"""verl adapter: vLLM speculative config construction and draft-weight sync against stand-ins
(the real vLLM path needs a GPU: scripts/gpu/verl_gpu_smoke.py)."""

from __future__ import annotations

import pytest
import torch
from grpo_parts_adapters.verl import speculative as spec

from grpo_parts.errors import GRPOPartsError
from grpo_parts.sampler.vllm import VLLMSpeculative, check_k_table


def test_config_and_overrides():
    ng = VLLMSpeculative(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    assert ng.to_vllm(1024) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    ea = VLLMSpeculative(method="eagle", model="/ckpt/draft", num_speculative_tokens=5)
    assert spec.hydra_overrides(ea) == [
        f"+{spec.OVERRIDE_PREFIX}.method=eagle",
        f"+{spec.OVERRIDE_PREFIX}.num_speculative_tokens=5",
        f"+{spec.OVERRIDE_PREFIX}.model=/ckpt/draft",
    ]
    with pytest.raises(ValueError, match="model: method 'eagle' needs a draft"):
        VLLMSpeculative(method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        VLLMSpeculative(method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)


def test_draft_length_table_reaches_verls_vllm_config():
    """FastGRPO's draft length per batch size, in verl's composed config as vLLM takes it: an
    explicit table, and the cost model's timed on the policy (k_schedule='cost_model')."""
    pytest.importorskip("verl")
    from grpo_parts.tiny import tiny_causal_lm

    table = [(1, 16, 3), (17, 1024, 0)]
    explicit = VLLMSpeculative(method="ngram", num_speculative_tokens=3, k_per_batch_size=table)
    cfg = _compose(
        spec.hydra_overrides(explicit)
    ).actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config
    assert [tuple(r) for r in cfg.num_speculative_tokens_per_batch_size] == table
    planned = VLLMSpeculative(method="ngram", num_speculative_tokens=3, k_schedule="cost_model")
    with pytest.raises(GRPOPartsError, match="policy: k_schedule='cost_model'"):
        spec.hydra_overrides(planned, 8)
    policy = tiny_causal_lm("llama", vocab_size=32, hidden_size=32, num_layers=1, seed=0)
    cfg = _compose(spec.hydra_overrides(planned, 8, policy)).actor_rollout_ref.rollout.engine_kwargs.vllm
    got = [tuple(r) for r in cfg.speculative_config.num_speculative_tokens_per_batch_size]
    assert check_k_table(got, 3) == [] and got[-1][1] == 8


def _compose(overrides):
    import os

    import verl
    from hydra import compose, initialize_config_dir

    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


class _Drafter(torch.nn.Linear):
    def load_weights(self, weights):
        sd = dict(weights)
        self.load_state_dict(sd)
        return set(sd)


class _Worker:
    def __init__(self):
        self.model_runner = type("R", (), {})()
        self.model_runner.drafter = type("D", (), {})()
        self.model_runner.drafter.model = _Drafter(3, 2)


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _ServerHandle:
    """Stand-in for verl's vLLM server actor: collective_rpc runs the callable on each TP worker."""

    def __init__(self, tp: int = 2):
        self.workers = [_Worker() for _ in range(tp)]
        self.collective_rpc = _Remote(self._rpc)

    def _rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(w, *args, **(kwargs or {})) for w in self.workers]


def test_sync_draft_weights_reaches_every_worker_of_every_replica():
    draft = torch.nn.Linear(3, 2)
    handles = [_ServerHandle(), _ServerHandle(tp=1)]
    assert spec.sync_draft_weights(handles, draft.state_dict(), get=lambda fs: fs) == 2
    for h in handles:
        for w in h.workers:
            assert torch.equal(w.model_runner.drafter.model.weight, draft.weight)
    bare = _ServerHandle(1)
    bare.workers[0].model_runner.drafter = None
    with pytest.raises(RuntimeError, match="no drafter model"):
        spec.sync_draft_weights([bare], draft.state_dict(), get=lambda fs: fs)
