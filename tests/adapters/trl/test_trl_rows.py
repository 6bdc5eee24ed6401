"""Row bookkeeping of the TRL adapter: prompt runs, regrouping after TRL's shuffle, the
steps_per_generation rounding rule and stacking of refill batches."""

from __future__ import annotations

import torch
from grpo_parts_adapters.trl.rows import (
    concat_batches,
    group_by_prompt,
    prompt_runs,
    regroup_microbatches,
    regrouped_logprobs,
    round_kept,
)

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.reference import RepeatedPrefixAttention
from grpo_parts.tiny import tiny_causal_lm
from grpo_parts.types import ScoredBatch


def test_prompt_runs() -> None:
    rows = [[1, 2]] * 3 + [[3]] * 3
    assert prompt_runs(rows, 3) == ([[1, 2], [3]], 3)
    assert prompt_runs(rows, 2) == (rows, 1)  # not runs of 2: every row its own prompt
    assert prompt_runs([[1], [2], [1], [2]], 2) == ([[1], [2], [1], [2]], 1)


def test_group_by_prompt_ignores_row_order() -> None:
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 0, 6]])
    mask = (ids != 0).long()
    g = group_by_prompt(ids, mask)
    assert g[0] == g[2] and len({int(g[0]), int(g[1]), int(g[3])}) == 3


def test_regrouped_logprobs_equal_direct_call_on_shuffled_rows() -> None:
    model = tiny_causal_lm("qwen2", vocab_size=32, dtype=torch.float64, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.tensor([[0, 0, 4, 5], [6, 7, 8, 9], [0, 3, 3, 3]])
    pm = (prompts != 0).long()
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])[torch.randperm(8, generator=gen)]
    comp = torch.randint(3, 32, (8, 5), generator=gen)
    cm = torch.ones_like(comp)
    cm[0, 3:] = 0
    cm[5, 1:] = 0
    ids = torch.cat([prompts[rows], comp.masked_fill(cm == 0, 0)], 1)
    mask = torch.cat([pm[rows], cm], 1)
    backend = RepeatedPrefixAttention()
    for bs in (None, 2, 3):
        lp, ent = regrouped_logprobs(backend, model, ids, mask, 5, 0.7, True, bs)
        want = backend.completion_logprobs(
            model, LogprobBatch(prompts[rows], pm[rows], comp, cm, rows), 0.7, True
        )
        assert want.entropies is not None and ent is not None
        torch.testing.assert_close(lp, want.logprobs, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, want.entropies, rtol=0, atol=1e-12)


def _scored(adv: list[float], groups: list[int]) -> ScoredBatch:
    a = torch.tensor(adv, dtype=torch.float64)
    return ScoredBatch(a.clone(), a, torch.tensor(groups))


def test_round_kept_restore_and_drop() -> None:
    s = _scored([0.5, -2.0, 0.1, 1.0, 0.0, 0.0], [0, 0, 0, 0, 1, 1])  # group 1 has zero variance
    kept = [torch.tensor([1, 3, 0])]
    up, change = round_kept([s], kept, 2, "up")
    assert change == 1 and up[0].tolist() == [0, 1, 2, 3]  # next by |A| is row 2, zero-variance rows last
    down, change = round_kept([s], kept, 2, "down")
    assert change == -1 and down[0].tolist() == [1, 3]  # row 0 has the smallest |A| of the kept
    empty, change = round_kept([s], [torch.zeros(0, dtype=torch.long)], 2, "down")
    assert change == 2 and empty[0].tolist() == [1, 3]  # nothing kept: restore the best rows
    same, change = round_kept([s], [torch.tensor([1, 3])], 2, "up")
    assert change == 0 and same[0].tolist() == [1, 3]


def test_concat_batches_repads() -> None:
    a = {
        "prompt_ids": torch.tensor([[0, 5], [6, 7]]),
        "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
        "completion_ids": torch.tensor([[8, 1, 0], [9, 9, 1]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "num_items_in_batch": torch.tensor(5),
    }
    b = {
        "prompt_ids": torch.tensor([[4, 4, 4]]),
        "prompt_mask": torch.tensor([[1, 1, 1]]),
        "completion_ids": torch.tensor([[1]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([0.5]),
        "num_items_in_batch": torch.tensor(1),
    }
    out = concat_batches([a, b], pad_token_id=0)
    assert out["prompt_ids"].tolist() == [[0, 0, 5], [0, 6, 7], [4, 4, 4]]
    assert out["prompt_mask"].tolist() == [[0, 0, 1], [0, 1, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[8, 1, 0], [9, 9, 1], [1, 0, 0]]
    assert out["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out["advantages"].tolist() == [1.0, -1.0, 0.5]
    assert "num_items_in_batch" not in out  # recomputed by the caller


def test_regroup_microbatches_keeps_prompts_together() -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.tensor([[0, 4], [5, 6], [7, 8], [0, 9]]).repeat_interleave(3, 0)  # 4 groups of 3
    perm = torch.randperm(12, generator=gen)  # TRL's row shuffle
    batch = {
        "prompt_ids": prompts[perm],
        "prompt_mask": (prompts[perm] != 0).long(),
        "completion_ids": torch.arange(12)[perm, None],
        "advantages": torch.arange(12.0)[perm],
        "num_items_in_batch": torch.tensor(12),
        "tags": [f"r{i}" for i in perm.tolist()],
    }
    chunks = [
        {k: (v[i * 4 : (i + 1) * 4] if k != "num_items_in_batch" else v) for k, v in batch.items()}
        for i in range(3)
    ]
    out = regroup_microbatches(chunks, torch.Generator().manual_seed(1))
    assert len(out) == 3 and all(c["completion_ids"].shape[0] == 4 for c in out)
    rows = torch.cat([c["completion_ids"][:, 0] for c in out])
    assert sorted(rows.tolist()) == list(range(12))  # same rows, each once
    groups = (rows // 3).tolist()
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert len(runs) == 4  # every prompt's rows are contiguous
    for c in out:  # every per-row entry moved with its row
        assert c["advantages"].tolist() == c["completion_ids"][:, 0].double().tolist()
        assert c["tags"] == [f"r{int(i)}" for i in c["completion_ids"][:, 0]]
        assert int(c["num_items_in_batch"]) == 12


def test_regrouped_logprobs_skips_rows_without_completion_tokens() -> None:
    """Rows whose completion is fully masked (mask_truncated_completions) get 0, as TRL's forward
    gives; the other rows equal the backend's; all masked: zeros without a forward."""
    model = tiny_causal_lm("qwen2", vocab_size=32, dtype=torch.float64, seed=1)
    prompts = torch.tensor([[0, 4, 5], [6, 7, 8], [0, 4, 5], [6, 7, 8]])
    pm = (prompts != 0).long()
    comp = torch.tensor([[9, 10, 1], [11, 12, 13], [14, 1, 0], [15, 16, 17]])
    cm = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0]])  # rows 1 and 3: truncated, masked
    ids, mask = torch.cat([prompts, comp], 1), torch.cat([pm, cm], 1)
    backend = RepeatedPrefixAttention()
    lp, ent = regrouped_logprobs(backend, model, ids, mask, 3, 1.0, True)
    live = torch.tensor([0, 2])
    want = backend.completion_logprobs(
        model,
        LogprobBatch(prompts[live], pm[live], comp[live], cm[live], torch.zeros(2, dtype=torch.long)),
        1.0,
        True,
    )
    assert ent is not None and want.entropies is not None
    torch.testing.assert_close(lp[live], want.logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent[live], want.entropies, rtol=0, atol=1e-12)
    assert not lp[[1, 3]].any() and not ent[[1, 3]].any()
    none, none_ent = regrouped_logprobs(backend, model, ids[[1, 3]], mask[[1, 3]], 3, 1.0, False)
    assert none.shape == (2, 3) and not none.any() and none_ent is None


def test_rows_without_loss_rank_last() -> None:
    from grpo_parts_adapters.trl.rows import drop_no_loss_rows

    s = _scored([0.5, -2.0, 0.1, 1.0], [0, 0, 0, 0])
    no_loss = torch.tensor([False, True, False, False])  # row 1 has the largest |A| but no loss token
    up, change = round_kept([s], [torch.tensor([3])], 2, "up", [no_loss])
    assert change == 1 and up[0].tolist() == [0, 3]  # row 0 (|A| 0.5) restored, not row 1
    down, change = round_kept([s], [torch.tensor([0, 1, 3])], 2, "down", [no_loss])
    assert change == -1 and down[0].tolist() == [0, 3]  # row 1 dropped first
    assert drop_no_loss_rows([torch.tensor([1, 3])], [no_loss])[0].tolist() == [3]  # rows 0, 2 pruned
    assert drop_no_loss_rows([torch.tensor([0, 1, 2, 3])], [no_loss])[0].tolist() == [0, 1, 2, 3]
