"""TRL's own generation with the shared-prefix backend on Gemma2 (attention soft-capping, local
sliding-window layers; issue 25): the adapter keeps the shared-prefix kernel selected for the whole
``training_step``, so ``model.generate`` inside TRL's ``_prepare_inputs`` runs with it selected.
Outside the layout the kernel runs the model's own attention, so this trains as stock TRL does:
same completions, same rewards, and the loss and gradients of the stock run (float32 tolerance)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer  # noqa: E402
from transformers import set_seed  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_parts.tiny import tiny_causal_lm  # noqa: E402


def test_gemma2_trains_with_trls_own_generation() -> None:
    base = tiny_causal_lm(
        "gemma2",
        vocab_size=32,
        hidden_size=32,
        dtype=torch.float32,  # (transformers' float64 eager mask overflows to NaN on padded rows)
        attn_implementation="eager",  # soft-capping: transformers' eager is the only attention honouring it
        attn_logit_softcapping=50.0,
        sliding_window=16,  # local layers (wider than prompt + completion: the training forward refuses less)
        eos_token_id=1,
        pad_token_id=0,
    )
    args = _tiny.config(max_steps=2, gradient_accumulation_steps=2)
    set_seed(0)
    stock, cap_stock = _tiny.run(GRPOTrainer, base, args)
    set_seed(0)
    ours, cap_ours = _tiny.run(GRPOPartsTrainer, base, args, attention="shared_prefix")
    assert ours.gp_attention is not None
    logs = ours.state.log_history
    assert any(log.get("parts/attention/forwards", 0) > 0 for log in logs)  # the backend ran
    assert all(log.get("parts/attention/fallbacks", 0) == 0 for log in logs)
    for ls, lo in zip(stock.state.log_history[:2], logs[:2]):
        for key in ("completions/mean_length", "reward"):
            assert lo.get(key) == ls.get(key)  # TRL's generation: the same completions as stock
        assert lo["loss"] == pytest.approx(ls["loss"], rel=1e-4, abs=1e-6)
    for gs, go in zip(cap_stock.grads, cap_ours.grads):
        assert gs.keys() == go.keys() and gs
        for k in gs:  # float32: float tolerance
            torch.testing.assert_close(go[k], gs[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
