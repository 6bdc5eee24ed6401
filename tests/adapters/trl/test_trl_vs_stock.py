"""GRPOPartsTrainer against a stock TRL 1.16 GRPOTrainer in the configurations issue 15 named:
``mask_truncated_completions=True``, LoRA (``peft_config``), and the entropy options. Same seed,
same completions; the losses, gradients and parameters after two SGD steps agree to float tolerance
(TRL's fused LM head accumulates log-probs in float32 even for this float64 model). SGD, because
Adam's first step is ``lr * sign(g)`` and turns a 1e-12 gradient difference into a 2 * lr one."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer, TRLPartsOptions  # noqa: E402
from transformers import set_seed  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_parts.errors import NotSupportedError  # noqa: E402

G = 4


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return _tiny.model()


def _scripted(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Fixed completions (max_completion_length=4, EOS = 1): the 1st, 3rd... group of the batch
    mixes finished and truncated completions, the 2nd, 4th... has only truncated ones (with
    ``mask_truncated_completions`` a micro-batch holding that group has no loss token at all)."""
    mixed = [[5, 1], [7, 8, 9, 10], [11, 3, 1], [13, 1]]
    cut = [[17, 18, 19, 20], [21, 22, 23, 24], [25, 26, 27, 28], [3, 7, 11, 17]]
    return [(mixed if (i // G) % 2 == 0 else cut)[i % G] for i in range(len(prompt_ids))]


class _StockScripted(GRPOTrainer):
    def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
        return _scripted(prompt_ids), None


class _PartsScripted(GRPOPartsTrainer):
    def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
        return _scripted(prompt_ids), None


def _params(tr: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def _assert_same_run(stock: tuple[Any, Any], parts: tuple[Any, Any], steps: int = 2) -> None:
    (ts, cs), (tp, cp) = stock, parts
    assert len(cs.grads) == len(cp.grads) == steps
    for ls, lp in zip(ts.state.log_history[:steps], tp.state.log_history[:steps]):
        for key in ("completions/mean_length", "reward"):  # logged on generation steps
            assert lp.get(key) == ls.get(key)  # same completions, same rewards
        assert lp["loss"] == pytest.approx(ls["loss"], rel=1e-5, abs=1e-8)
    for gs, gp in zip(cs.grads, cp.grads):
        assert gs.keys() == gp.keys() and gs
        for k in gs:
            torch.testing.assert_close(gp[k], gs[k], rtol=1e-5, atol=5e-8, msg=lambda m, k=k: f"{k}: {m}")
    ps, pp = _params(ts), _params(tp)
    assert ps.keys() == pp.keys()
    for k in ps:
        torch.testing.assert_close(pp[k], ps[k], rtol=1e-6, atol=5e-9, msg=lambda m, k=k: f"{k}: {m}")


def _both(
    base: torch.nn.Module,
    args: Any,
    stock_cls: Any = GRPOTrainer,
    parts_cls: Any = GRPOPartsTrainer,
    **parts: Any,
):  # type: ignore[no-untyped-def]
    set_seed(0)
    stock = _tiny.run(stock_cls, base, args, **{k: v for k, v in parts.items() if k == "peft_config"})
    set_seed(0)
    ours = _tiny.run(parts_cls, base, args, **parts)
    return stock, ours


def test_mask_truncated_completions_with_shared_prefix_equals_stock(base: torch.nn.Module) -> None:
    """Truncated completions are masked entirely: rows with no completion token skip the backend and
    get TRL's zeros, a micro-batch with no token at all runs TRL's own forward (counted as a
    fallback); policy (with grad), old-policy (num_iterations=2) and reference (beta) log-probs."""
    args = _tiny.config(
        mask_truncated_completions=True,
        max_completion_length=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.1,
        max_steps=2,
        optim="sgd",
    )
    stock, ours = _both(base, args, _StockScripted, _PartsScripted, attention="shared_prefix")
    _assert_same_run(stock, ours)
    tr = ours[0]
    assert tr._gp_group_rows  # each micro-batch is one group: the all-truncated one has no token
    for log in tr.state.log_history[:2]:
        assert log["parts/attention/forwards"] >= 1
        assert log["parts/attention/fallbacks"] == 1  # the all-truncated micro-batch's grad forward
    assert any("every completion is masked" in r for r in tr._gp_counters.reasons["attention"])


def test_lora_with_shared_prefix_equals_stock(base: torch.nn.Module) -> None:
    """``peft_config=LoraConfig(...)``: the shared-prefix backend looks through the PeftModel to the
    base model's forward; the reference log-probs come from the adapter-disabled base (beta > 0)."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    args = _tiny.config(gradient_accumulation_steps=2, beta=0.1, max_steps=2, optim="sgd")
    stock, ours = _both(base, args, peft_config=lora, attention="shared_prefix")
    tr = ours[0]
    assert type(tr.gp_attention).__name__ == "SharedPrefixAttention"
    assert any("lora_" in k for k in ours[1].grads[0])
    _assert_same_run(stock, ours)
    for log in tr.state.log_history[:2]:
        assert log["parts/attention/forwards"] >= 3  # 2 micro-batches + the reference forward
        assert log["parts/attention/fallbacks"] == 0


def test_prompt_learning_peft_is_refused(base: torch.nn.Module) -> None:
    peft = pytest.importorskip("peft")
    from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention

    model = peft.get_peft_model(
        copy.deepcopy(base), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    )
    reasons = SharedPrefixAttention().not_supported_reasons(model)
    assert any("virtual tokens" in r for r in reasons)


def test_entropy_options_equal_stock(base: torch.nn.Module) -> None:
    """``top_entropy_quantile`` and the entropy bonus are computed per micro-batch by TRL: with an
    attention backend the default ``group_rows`` stays off for them, so the run is TRL's."""
    args = _tiny.config(
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        gradient_accumulation_steps=2,
        max_steps=2,
        optim="sgd",
    )
    stock, ours = _both(base, args, attention="shared_prefix")
    assert not ours[0]._gp_group_rows
    _assert_same_run(stock, ours)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
        ({"use_adaptive_entropy": True}, "entropy bonus"),
        ({"loss_type": "bnpo"}, "bnpo"),
    ],
)
def test_group_rows_true_is_refused_where_the_loss_depends_on_the_micro_batch(
    base: torch.nn.Module, overrides: dict[str, Any], match: str
) -> None:
    args = _tiny.config(**overrides)
    with pytest.raises(NotSupportedError, match=match):
        _tiny.build(GRPOPartsTrainer, base, args, parts={"group_rows": True})
    tr = _tiny.build(
        GRPOPartsTrainer, base, args, parts={"group_rows": True}, parts_options=TRLPartsOptions(strict=False)
    )
    assert not tr._gp_group_rows and match in " ".join(tr.parts_refused["group_rows"])
