"""verl adapter: vLLM speculative config construction and draft-weight sync against stand-ins
(the real vLLM path needs a GPU: scripts/gpu/verl_gpu_smoke.py)."""

from __future__ import annotations

import pytest
import torch
from grpo_parts_adapters.verl import speculative as spec


def test_config_and_overrides():
    ng = spec.VllmSpeculativeOptions(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    assert ng.to_vllm() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    ea = spec.VllmSpeculativeOptions(method="eagle", model="/ckpt/draft", num_speculative_tokens=5)
    assert ea.hydra_overrides() == [
        f"+{spec.OVERRIDE_PREFIX}.method=eagle",
        f"+{spec.OVERRIDE_PREFIX}.num_speculative_tokens=5",
        f"+{spec.OVERRIDE_PREFIX}.model=/ckpt/draft",
    ]
    with pytest.raises(ValueError, match="model: expected a draft path"):
        spec.VllmSpeculativeOptions(method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        spec.VllmSpeculativeOptions(prompt_lookup_min=5, prompt_lookup_max=2)


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
