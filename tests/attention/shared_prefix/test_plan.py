"""The shared-prefix call is planned once (src/grpo_parts/attention/shared_prefix/plan.py): one plan
object says what runs, the run decides nothing, and the batch passes through the package in one
direction."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.attention.shared_prefix import SharedPrefixAttention
from grpo_parts.attention.shared_prefix.facts import GroupFacts
from grpo_parts.tiny import tiny_causal_lm

PACKAGE = Path(SharedPrefixAttention.__module__.replace(".", "/")).parent.as_posix()


def _batch(groups: list[int], lengths: list[int], prompt: int = 5, vocab: int = 32) -> LogprobBatch:
    gen = torch.Generator().manual_seed(0)
    gi = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(groups))
    n = int(gi.numel())
    clen = torch.tensor([lengths[i % len(lengths)] for i in range(n)])
    t = int(clen.max())
    prompts = torch.randint(1, vocab, (len(groups), prompt), generator=gen)
    return LogprobBatch(
        prompts[gi],
        torch.ones(n, prompt, dtype=torch.long),
        torch.randint(1, vocab, (n, t), generator=gen),
        (torch.arange(t) < clen[:, None]).long(),
        gi,
    )


def _stays(call: Any, batch: LogprobBatch) -> list[str]:
    """The package's files that frames receiving ``batch`` itself run in, in order, consecutive
    repeats collapsed (a stay)."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or PACKAGE not in frame.f_code.co_filename.replace("\\", "/"):
            return
        if any(v is batch for v in frame.f_locals.values()):
            name = Path(frame.f_code.co_filename).name
            if not seen or seen[-1] != name:
                seen.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize(
    ("layout", "options", "groups", "lengths"),
    [
        ("grid", {}, [4, 4], [3, 5]),
        ("grid", {"chunk_overhead_tokens": -1}, [3, 2, 4], [1, 9, 2, 30]),
        ("padding_free", {}, [4, 2], [2, 7, 1]),
        ("auto", {}, [4, 2, 3], [2, 40, 1]),
    ],
)
def test_the_batch_visits_each_file_of_the_package_at_most_twice(layout, options, groups, lengths) -> None:  # type: ignore[no-untyped-def]
    model = tiny_causal_lm("llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    batch = _batch(groups, lengths)
    backend = SharedPrefixAttention(layout=layout, **options)
    stays = _stays(lambda: backend.completion_logprobs(model, batch), batch)
    counts = {f: stays.count(f) for f in stays}
    assert max(counts.values()) <= 2, stays
    assert "plan.py" in stays and stays.count("plan.py") == 1


def test_the_plan_says_what_runs_and_the_run_follows_it() -> None:
    model = tiny_causal_lm("llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    batch = _batch([3, 2, 4], [1, 9, 2, 30])
    backend = SharedPrefixAttention(layout="grid", chunk_overhead_tokens=-1)
    plan = backend.plan(model, batch)
    assert plan.model_calls == len(plan.calls) > 1 and plan.empty_calls == 0
    assert sorted(torch.cat(plan.calls).tolist()) == list(range(9))
    backend.run(model, batch, plan.agreed(plan.model_calls + 2))
    assert backend.last_plan["empty_calls"] == 2 and backend.last_plan["chunks"] == len(plan.calls)
    assert backend.last_plan["kernel"] == plan.kernel and backend.layout_counts == {"grid": 1}


def test_group_facts_are_read_once_and_count_the_layouts() -> None:
    batch = _batch([3, 1], [2, 6])
    facts = GroupFacts.of(batch)
    assert facts.rows.tolist() == [3, 1] and facts.longest.tolist() == [6, 6]
    assert facts.packed_tokens == 4 * 5 + (2 + 6 + 2 + 6)
    assert facts.padding_free_tokens == 2 * 5 + (2 + 6 + 2 + 6)
