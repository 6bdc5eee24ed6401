"""What the TRL adapter reports: per-step counters of what went through each part (and what fell
back), the ``attention="auto"`` choice, the ``kept`` column of TRL's completions table, the TRL
version check; and CPPO's ranking when ``mask_truncated_completions`` leaves rows without loss."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer, TRLPartsOptions  # noqa: E402
from test_trl_vs_stock import _PartsScripted  # noqa: E402
from transformers import set_seed  # noqa: E402

from grpo_parts.counters import PartCounters  # noqa: E402
from grpo_parts.errors import NotSupportedError  # noqa: E402


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return _tiny.model()


def test_default_trl_config_with_the_parts_on_reports_that_they_ran(tmp_path: Path) -> None:
    """GRPOConfig defaults (bf16, gradient checkpointing, dapo, 8 generations, ...) except what a CPU
    and a tiny float32 model need (use_cpu, a short max_completion_length, 2 steps logged each):
    every step's metrics say the sampler, the attention backend and the filter ran, none fell back."""
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
    )
    assert args.bf16 and args.gradient_checkpointing and args.loss_type == "dapo"
    set_seed(0)
    tr = GRPOPartsTrainer(
        model=_tiny.model(dtype=torch.float32),
        reward_funcs=_tiny.reward,
        args=args,
        train_dataset=_tiny.dataset(),
        processing_class=_tiny.tokenizer(),
        sampler="speculative",
        draft="ngram",
        attention="auto",
        filter="cppo",
        filter_kwargs={"pruning_rate": 0.5},
    )
    assert type(tr.gp_attention).__name__ == "SharedPrefixAttention" and tr._gp_group_rows
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["parts/sampler/rollouts"] == 1 and log["parts/sampler/fallbacks"] == 0
        assert log["parts/attention/forwards"] == 1 and log["parts/attention/fallbacks"] == 0
        assert log["parts/filter/calls"] == 1 and log["parts/filter/fallbacks"] == 0
        assert log["parts/filter/num_kept"] == 4  # CPPO at 0.5 of 8 completions
    assert not tr._gp_counters.reasons


def test_auto_attention_logs_its_choice_and_warns_on_fallback(
    base: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="grpo_parts_adapters")
    _tiny.build(GRPOPartsTrainer, base, _tiny.config(), attention="auto")
    assert any(r.levelno == logging.INFO and "chose 'shared_prefix'" in r.message for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    caplog.clear()
    dropout = copy.deepcopy(base)
    dropout.config.attention_dropout = 0.1  # shared_prefix cannot match the reference's randomness
    set_seed(0)
    tr, _ = _tiny.run(GRPOPartsTrainer, dropout, _tiny.config(), attention="auto")
    assert type(tr.gp_attention).__name__ == "RepeatedPrefixAttention"
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "chose 'reference'" in w and "attention dropout" in w]) == 1
    log = tr.state.log_history[0]
    assert log["parts/attention/forwards"] == 0 and log["parts/attention/fallbacks"] == 1


def test_refused_part_counts_fallbacks(base: torch.nn.Module) -> None:
    args = _tiny.config(generation_kwargs={"do_sample": True})
    set_seed(0)
    tr, _ = _tiny.run(
        GRPOPartsTrainer, base, args, sampler="reference", parts_options=TRLPartsOptions(strict=False)
    )
    log = tr.state.log_history[0]
    assert log["parts/sampler/rollouts"] == 0 and log["parts/sampler/fallbacks"] == 1
    assert "generation_kwargs" in tr._gp_counters.reasons["sampler"][0]


def test_untested_trl_version_is_refused(
    base: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(NotSupportedError, match=r"TRL 1.17.0 is outside the tested range >=1.16,<1.17"):
        _tiny.build(GRPOPartsTrainer, base, _tiny.config())
    opts = TRLPartsOptions(allow_untested_trl=True)
    _tiny.build(GRPOPartsTrainer, base, _tiny.config(), parts_options=opts)
    assert any("allow_untested_trl" in r.message and r.levelno == logging.WARNING for r in caplog.records)


def test_part_counters() -> None:
    c = PartCounters({"attention": "forwards", "filter": "calls"}, logging.getLogger("t"))
    c.track("filter")
    c.ran("attention", 2)
    c.fell_back("attention", "why")
    c.fell_back("attention", "why", mode="eval")
    assert c.flush() == {
        "parts/attention/forwards": 2.0,
        "parts/attention/fallbacks": 1.0,
        "parts/filter/calls": 0.0,
        "parts/filter/fallbacks": 0.0,
    }
    assert c.flush()["parts/attention/forwards"] == 0.0  # reset
    assert c.flush("eval")["parts/attention/fallbacks"] == 1.0
    assert c.reasons == {"attention": ["why"]} and c.total("attention", "fallbacks") == 2
    with pytest.raises(KeyError):
        c.ran("sampler")


class _Trained(_PartsScripted):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.trained: list[dict[str, Any]] = []
        self.scored: list[Any] = []

    def _gp_score(self, inputs):  # type: ignore[no-untyped-def]
        out = super()._gp_score(inputs)
        self.scored.append(out)
        return out

    def _compute_loss(self, model, inputs):  # type: ignore[no-untyped-def]
        self.trained.append(dict(inputs))
        return super()._compute_loss(model, inputs)


def _texts(tok: Any, batch: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for i in range(batch["completion_ids"].shape[0]):
        p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        c = batch["completion_ids"][i][: int((batch["completion_ids"][i] != 0).sum())]
        out.append((tok.decode(p, skip_special_tokens=True), tok.decode(c, skip_special_tokens=True)))
    return out


def test_cppo_ranks_only_rows_with_loss_tokens_and_logs_kept(base: torch.nn.Module, tmp_path: Path) -> None:
    """mask_truncated_completions=True: half the batch is truncated (no loss token), yet its
    advantages are TRL's (large |A|). CPPO keeps the rows with loss tokens by |A|; no truncated
    row is trained; the completions table TRL writes has a ``kept`` column marking the trained rows."""
    args = _tiny.config(
        output_dir=str(tmp_path),
        mask_truncated_completions=True,
        max_completion_length=4,
        gradient_accumulation_steps=2,
        log_completions=True,
    )
    set_seed(0)
    tr, _ = _tiny.run(_Trained, base, args, filter="cppo", filter_kwargs={"pruning_rate": 0.75})
    ((out, _, scored),) = tr.scored
    loss_rows = scored.completion_lengths > 0
    assert 0 < int(loss_rows.sum()) < scored.size
    assert float(out["advantages"][~loss_rows].abs().max()) > 0  # TRL gives them advantages
    trained = [r for b in tr.trained for r in _texts(tr.processing_class, b)]
    assert all(b["completion_mask"].sum(-1).min() > 0 for b in tr.trained)  # no row without loss
    # the 2 kept rows (8 x (1 - 0.75)) are the loss rows with the largest |A|, ties to the lower row;
    # the truncated row with the largest |A| of all is not among them
    adv = out["advantages"].abs().masked_fill(~loss_rows, -1.0)
    k = len(trained)
    assert k == 2 and not bool(loss_rows[int(out["advantages"].abs().argmax())])
    want = torch.argsort(adv, descending=True, stable=True)[:k]
    assert sorted(trained) == sorted(_texts(tr.processing_class, out)[i] for i in want.tolist())
    log = tr.state.log_history[0]
    assert log["parts/filter/no_loss_rows"] == int((~loss_rows).sum())
    # the kept column: one flag per logged completion, True exactly for the trained rows
    kept = list(tr._logs["extra"]["kept"])
    assert len(kept) == len(tr._logs["prompt"]) == scored.size and sum(kept) == k
    import pandas as pd

    (table,) = (tmp_path / "completions").glob("*.parquet")
    df = pd.read_parquet(table)
    assert "kept" in df.columns and int(df["kept"].sum()) == k
    logged = sorted((p, c) for p, c, f in zip(df["prompt"], df["completion"], df["kept"]) if f)
    assert logged == sorted(trained)
