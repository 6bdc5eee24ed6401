"""``grpo_parts.tiny``: the qwen2 -> llama export of the shipped warm starts is the same function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_parts.errors import GRPOPartsError
from grpo_parts.tiny import qwen2_as_llama, tiny_causal_lm


def test_qwen2_as_llama_has_the_same_logits_and_gradients() -> None:
    q = tiny_causal_lm("qwen2", vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       dtype=torch.float64, seed=3)  # fmt: skip
    with torch.no_grad():  # random q/k/v biases, so that they have to be carried over
        for layer in q.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    llama = qwen2_as_llama(q)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.model_type == "llama"
    ids = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(0))
    lq, ll = q(ids).logits, llama(ids).logits
    torch.testing.assert_close(ll, lq, rtol=0, atol=1e-12)
    lq.square().mean().backward()
    ll.square().mean().backward()
    gq = dict(q.named_parameters())
    for name, p in llama.named_parameters():
        if name.endswith("o_proj.bias"):  # llama's extra parameter: zero, and trainable
            assert torch.equal(p, torch.zeros_like(p))
            continue
        torch.testing.assert_close(p.grad, gq[name].grad, rtol=0, atol=1e-12, msg=name)


def test_qwen2_as_llama_refuses_other_models() -> None:
    with pytest.raises(GRPOPartsError, match="model: expected a qwen2"):
        qwen2_as_llama(tiny_causal_lm("llama", vocab_size=16))


@pytest.mark.parametrize("task", ["reasoning", "arithmetic"])
def test_the_shipped_warm_starts_load_with_plain_auto_tokenizer(task: str) -> None:
    """transformers 5 overrides the declared tokenizer class of qwen2 folders (dropping spaces); the
    shipped folders are llama, so AutoTokenizer keeps one token per character, spaces too."""
    from transformers import AutoTokenizer

    from grpo_parts.train.lifecycle.setup import builtin_model_path

    path = Path(builtin_model_path(task))
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "12 + 34 = 46;46" if task == "arithmetic" else "add the terms: a3 + b1 = 4;4"
    assert all(c in tok.get_vocab() for c in text)
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
