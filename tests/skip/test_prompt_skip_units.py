"""The ``history`` prompt skipper and its draw, unit by unit: the floor, adaptivity, history across
epochs, the round a draw hands out, the state round trip, the reference, and one-line errors."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch

from grpo_parts.build import build_prompt_skipper
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.reference import KeepAll
from grpo_parts.filter.refill import Refiller, fill_rollouts
from grpo_parts.skip import IMPLEMENTATIONS, get_skipper_class
from grpo_parts.skip.draw import PromptDraw
from grpo_parts.skip.history import HistorySkipper
from grpo_parts.skip.protocol import PromptSkipper, ReportsHistory, SkipDecision, prompt_key, skips
from grpo_parts.skip.reference import KeepEveryPrompt
from grpo_parts.types import Rollout

ZERO = torch.tensor([1.0, 1.0])
MIXED = torch.tensor([1.0, 0.0])
TWO = torch.zeros(2, dtype=torch.long)


def see(skipper: HistorySkipper, pid: int, rewards: torch.Tensor, times: int = 1) -> None:
    for _ in range(times):
        skipper.observe([pid], rewards, TWO, torch.tensor([4, 6]))


def test_both_names_build_and_satisfy_the_protocol() -> None:
    assert set(IMPLEMENTATIONS) == {"none", "history"}
    for name in IMPLEMENTATIONS:
        s = build_prompt_skipper(name)
        assert isinstance(s, PromptSkipper) and get_skipper_class(name).name == name
    assert isinstance(build_prompt_skipper("history"), ReportsHistory)
    assert not skips(KeepEveryPrompt()) and skips(HistorySkipper()) and not skips(None)
    d = KeepEveryPrompt().decide([5, 6, 7])
    assert d.kept.tolist() == [0, 1, 2] and d.weights is None and d.skipped.numel() == 0


def test_probability_rule_floor_and_streaks() -> None:
    s = HistorySkipper(min_keep_prob=0.1, keep_base=0.5, base_step=0.0, min_streak=2, window=3)
    assert s.inclusion_probability(1) == 1.0  # never seen
    see(s, 1, ZERO)
    assert s.inclusion_probability(1) == 1.0  # a streak of 1 < min_streak
    see(s, 1, ZERO)
    assert s.inclusion_probability(1) == 0.25  # 0.5 ** 2
    see(s, 1, ZERO, times=5)
    assert s.record(1).streak == 3 and s.inclusion_probability(1) == 0.125  # the window caps z at 3
    s2 = HistorySkipper(min_keep_prob=0.2, keep_base=0.5, base_step=0.0)
    see(s2, 1, ZERO, times=8)
    assert s2.inclusion_probability(1) == 0.2  # the floor: never skipped for sure
    see(s2, 1, MIXED)
    assert s2.inclusion_probability(1) == 1.0  # one informative group resets it


def test_a_draw_never_goes_below_the_floor_and_draws_at_most_n_over_it() -> None:
    s = HistorySkipper(min_keep_prob=0.25, keep_base=0.5, base_step=0.0)
    for pid in range(40):
        see(s, pid, ZERO, times=6)  # every prompt at the floor
    draw = PromptDraw(s, iter(range(40)), key=lambda x: x)
    got = draw.take(3)
    (r,) = draw.rounds
    assert (
        r.drawn == 12
        and len(got) == 3
        and torch.allclose(r.weights, torch.full((3,), 4.0, dtype=torch.float64))
    )
    assert draw.normaliser_scale() == 4.0


def test_a_round_is_topped_up_to_n_and_the_prompt_that_does_not_fit_stays() -> None:
    s = HistorySkipper(min_keep_prob=0.1, keep_base=0.5, base_step=0.0)
    see(s, 0, ZERO)  # p = 0.5
    see(s, 1, ZERO)
    stream = iter(range(100))
    draw = PromptDraw(s, stream, key=lambda x: x)
    first = draw.take(3)  # 0.5 + 0.5 + 1 = 2 fits, + prompt 3 (p = 1) = 3: exactly 3
    assert len(first) == 3 and draw.rounds[0].drawn == 4
    second = draw.take(2)
    assert second == [4, 5]  # nothing lost, nothing repeated
    see(s, 6, ZERO)  # 0.5
    third = draw.take(1)  # 0.5 fits, the next (p = 1) does not: 0.5 raised to 1
    assert third == [6] and draw.rounds[-1].weights.tolist() == [1.0]
    assert next(stream) == 8 and draw.take(1) == [7]  # a plain iterator: the draw holds the one read ahead


class Peekable(Iterator[int]):
    def __init__(self) -> None:
        self.pos = 0

    def __next__(self) -> int:
        self.pos += 1
        return self.pos - 1

    def peek(self) -> int:
        return self.pos


def test_a_stream_with_peek_keeps_its_position_exact() -> None:
    s = HistorySkipper(min_keep_prob=0.1, base_step=0.0)
    see(s, 2, ZERO)
    stream = Peekable()
    PromptDraw(s, stream, key=lambda x: x).take(2)  # 0 (1) + 1 (1) = 2: prompt 2 is peeked, not taken
    assert stream.pos == 2


def test_adaptivity_both_targets() -> None:
    s = HistorySkipper(keep_base=0.5, base_step=0.1, min_base=0.2, max_base=0.8, target_share=0.5)
    s.observe([1, 2], torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))  # share 0.5 >= 0.5
    assert s.base == pytest.approx(0.4)
    s.observe([3, 4], torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))  # share 0
    assert s.base == pytest.approx(0.5)
    for _ in range(10):
        s.observe([5], ZERO, TWO)
    assert s.base == pytest.approx(0.2)  # clamped at min_base
    k = HistorySkipper(target="skip", target_share=0.3, keep_base=0.5, base_step=0.1)
    k.decide([1, 2, 3])  # nothing to skip yet: skip share 0 < 0.3 -> skip more
    k.observe([1], MIXED, TWO)
    assert k.base == pytest.approx(0.4) and k.history_stats()["skip_share"] == 0.0


def test_history_carries_across_epochs_of_a_cycling_stream() -> None:
    data = [f"{i}+{i}=" for i in range(4)]
    s = HistorySkipper(min_keep_prob=0.2, keep_base=0.5, base_step=0.0)
    epoch = PromptDraw(s, iter(data), key=prompt_key)
    assert epoch.take(4) == data  # epoch 1: no history, all kept
    s.observe(
        [prompt_key(x) for x in data],
        torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1]),
        torch.arange(4).repeat_interleave(2),
        torch.tensor([3, 3, 5, 5, 7, 7, 9, 9]),
    )
    assert [s.inclusion_probability(prompt_key(x)) for x in data] == [1.0, 1.0, 0.5, 0.5]
    epoch2 = PromptDraw(s, iter(data * 2), key=prompt_key)
    got = epoch2.take(3)  # 1 + 1 + 0.5 + 0.5 = 3: all four drawn, two of them zero-variance
    assert len(got) == 3 and epoch2.rounds[0].drawn == 4 and data[0] in got and data[1] in got
    m = epoch2.metrics(group_size=2, fallback_length=100.0)
    skipped = epoch2.rounds[0].skipped_ids
    assert m["prompts_skipped"] == 1.0 and m["prompts_drawn"] == 4.0 and m["skip_history_size"] == 4.0
    assert m["skip_rollout_tokens_saved"] == 2 * s.mean_completion_length(skipped[0])


def test_capacity_forgets_the_least_recently_observed() -> None:
    s = HistorySkipper(capacity=2, base_step=0.0)
    for pid in (1, 2, 1, 3):
        see(s, pid, ZERO)
    assert s.record(2) is None and s.record(1) is not None and s.record(3) is not None


def test_state_round_trips_under_weights_only() -> None:
    s = HistorySkipper(min_keep_prob=0.1, seed=5, window=4)
    for pid, rewards in ((1, ZERO), (2, MIXED), (3, ZERO), (1, ZERO)):
        see(s, pid, rewards)
    s.decide([1, 2, 3, 4], target=2)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = HistorySkipper(min_keep_prob=0.1, seed=99, window=4)
    t.load_state_dict(torch.load(buf, weights_only=True))
    assert t.base == s.base and t.history_stats() == s.history_stats()
    assert [t.inclusion_probability(i) for i in range(5)] == [s.inclusion_probability(i) for i in range(5)]
    assert t.record(1) == s.record(1) and t.mean_completion_length(2) == 5.0
    a, b = s.decide([1, 2, 3, 4], target=2), t.decide([1, 2, 3, 4], target=2)
    assert torch.equal(a.kept, b.kept) and torch.equal(a.probabilities, b.probabilities)
    with pytest.raises(GRPOPartsError, match=r"^prompt_skip state: expected the key 'ids'"):
        t.load_state_dict({})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"min_keep_prob": 0.0},
            r"^prompt_skip_kwargs\.min_keep_prob: Input should be greater than 0, got 0\.0",
        ),
        (
            {"min_keep_prob": 1.5},
            r"^prompt_skip_kwargs\.min_keep_prob: Input should be less than or equal to 1",
        ),
        (
            {"keep_base": 0.99},
            r"keep_base: expected a value in \[min_base, max_base\] = \[0\.05, 0\.95\], got 0\.99",
        ),
        ({"min_streak": 9}, r"min_streak: expected <= window=8 \(groups remembered\), got 9"),
        (
            {"target": "both"},
            r"^prompt_skip_kwargs\.target: Input should be 'zero_variance' or 'skip', got 'both'",
        ),
        (
            {"windw": 3},
            r"^prompt_skip_kwargs\.windw: prompt_skip 'history' has no argument 'windw' \(got 3\)",
        ),
    ],
)
def test_bad_kwargs_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(GRPOPartsError, match=message) as e:
        build_prompt_skipper("history", kwargs=kwargs)
    assert "\n" not in str(e.value)


def test_bad_inputs_are_one_line_errors() -> None:
    with pytest.raises(
        GRPOPartsError,
        match=r"^prompt_skip: unknown implementation 'greso'; expected one of \['history', 'none'\]",
    ):
        build_prompt_skipper("greso")
    with pytest.raises(
        GRPOPartsError,
        match=r"^group_index: expected values in \[0, 1\) \(positions in prompt_ids\), got range \[0, 1\]",
    ):
        HistorySkipper().observe([1], MIXED, torch.tensor([0, 1]))
    with pytest.raises(GRPOPartsError, match=r"^SkipDecision.kept: expected strictly ascending positions"):
        SkipDecision(torch.tensor([1, 0]), None, torch.ones(2, dtype=torch.float64))


def test_fill_rollouts_draws_its_rounds_through_the_skipper() -> None:
    """The refill hands out rounds of kept prompts; the rolled-out prompts' weights line up with
    ``FilledBatch.full_group``."""
    s = HistorySkipper(min_keep_prob=0.1, keep_base=0.5, base_step=0.0, seed=1)
    for pid in (1, 2, 3):
        see(s, pid, ZERO)
    draw = PromptDraw(s, iter(range(1, 50)), key=lambda x: x)

    def sample(batch: list[int]) -> Rollout:
        n, g = len(batch), 2
        ones = torch.ones(n * g, 2, dtype=torch.long)
        return Rollout(ones, ones, ones, ones, torch.zeros(n * g, 2), torch.arange(n).repeat_interleave(g), n)

    def reward(batch: list[int], ro: Rollout) -> torch.Tensor:
        return torch.tensor([float(batch[int(g)] % 2) + 0.1 * i for i, g in enumerate(ro.group_index)])

    filled = fill_rollouts(
        KeepAll(), Refiller(target_size=8, initial_prompts=4, max_rounds=1), draw, sample, reward
    )
    (r,) = draw.rounds
    assert len(filled.prompts) == 4 and r.drawn == 5  # 0.5 x 3 + 1 + 1 = 3.5, + prompt 5 = 4.5 > 4
    assert filled.full_group is not None
    w = draw.prompt_weights()[filled.full_group]
    assert w.numel() == 8 and torch.equal(w, r.weights.repeat_interleave(2))
    # 0.5 x 3 + 1 + 1 = 3.5 raised to 4: the three to 2/3 (weight 1.5), the fresh two stay at 1
    assert r.kept_ids[2:] == [4, 5] and torch.allclose(
        r.weights, torch.tensor([1.5, 1.5, 1.0, 1.0], dtype=torch.float64)
    )


def test_the_docs_example_runs() -> None:
    import contextlib
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "filter.md").read_text()
    section = text[text.index("## Skipping prompts before rollout") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code.group(1), "docs/filter.md", "exec"), {})
    assert buf.getvalue().split("\n")[:2] == ["0.5 1.0", "2 3 [2.0, 1.0] 1.5"]


def test_fewer_draws_the_step_and_rolls_out_only_the_kept() -> None:
    """``step_size="fewer"``: the round draws exactly ``n`` prompts, keeps each with its own
    probability (not raised to fill the step), and the normaliser is the ``n`` drawn; the expected
    weighted sum over every outcome of the design is the drawn batch's (exact enumeration)."""
    from skip_outcomes import systematic_outcomes

    data = [f"{i}+{i}=" for i in range(4)]
    s = HistorySkipper(min_keep_prob=0.2, keep_base=0.5, base_step=0.0, step_size="fewer")
    s.observe(
        [prompt_key(x) for x in data],
        torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1]),
        torch.arange(4).repeat_interleave(2),
        torch.tensor([3, 3, 5, 5, 7, 7, 9, 9]),
    )
    p = [s.inclusion_probability(prompt_key(x)) for x in data]
    assert p == [1.0, 1.0, 0.5, 0.5]
    draw = PromptDraw(s, iter(data * 2), key=prompt_key)
    got = draw.take(4)
    assert draw.rounds[0].drawn == 4 and len(got) == 3  # sum p = 3 rolled out of the 4 drawn
    assert data[0] in got and data[1] in got and draw.normaliser_scale() == pytest.approx(4 / 3)
    weights = draw.prompt_weights().tolist()
    assert sorted(weights) == [1.0, 1.0, 2.0]
    # unbiased: every outcome of the design, weighted 1/p, sums to the drawn batch's total
    values = [3.0, -1.0, 5.0, 2.0]
    expected = sum(
        prob * sum(values[i] / p[i] for i in kept) for kept, prob in systematic_outcomes(p).items()
    )
    assert expected == pytest.approx(sum(values))


def test_fewer_rolls_out_at_least_one_prompt() -> None:
    s = HistorySkipper(min_keep_prob=0.1, keep_base=0.1, base_step=0.0, step_size="fewer")
    for pid in range(3):
        see(s, pid, ZERO)
    draw = PromptDraw(s, iter([0, 1, 2]), key=int)
    assert len(draw.take(3)) == 1  # 3 x 0.1 raised to 1: a round never rolls out nothing
    assert draw.rounds[0].weights.tolist() == [pytest.approx(3.0)]


def test_fewer_rolls_out_at_least_its_floor_share_unbiased() -> None:
    """``min_rollout_share``: a ``fewer`` round whose probabilities sum under the floor raises them
    together until they reach it (fixed before the draw), so it rolls out exactly that many, each
    weighing less; every outcome of the design, weighted ``1 / p``, still sums to the drawn batch's."""
    from skip_outcomes import systematic_outcomes

    s = HistorySkipper(
        min_keep_prob=0.2, keep_base=0.2, base_step=0.0, step_size="fewer", min_rollout_share=0.5
    )
    for pid in (1, 2, 3):
        see(s, pid, ZERO)
    assert [s.inclusion_probability(i) for i in range(4)] == [1.0, 0.2, 0.2, 0.2]  # sum 1.6 < 2
    for _ in range(20):
        draw = PromptDraw(s, iter(range(4)), key=int)
        got = draw.take(4)
        assert len(got) == 2 and 0 in got and draw.rounds[0].drawn == 4
        assert sorted(draw.prompt_weights().tolist()) == [1.0, pytest.approx(3.0)]
    p = [1.0, 1 / 3, 1 / 3, 1 / 3]
    values = [3.0, -1.0, 5.0, 2.0]
    expected = sum(
        prob * sum(values[i] / p[i] for i in kept) for kept, prob in systematic_outcomes(p).items()
    )
    assert expected == pytest.approx(sum(values))
    unfloored = HistorySkipper(min_keep_prob=0.2, keep_base=0.2, base_step=0.0, step_size="fewer")
    for pid in (1, 2, 3):
        see(unfloored, pid, ZERO)
    assert all(len(PromptDraw(unfloored, iter(range(4)), key=int).take(4)) <= 2 for _ in range(20))


def test_min_rollout_share_is_for_fewer_steps_only() -> None:
    with pytest.raises(ValueError, match="min_rollout_share: a floor on the prompts a 'fewer' step"):
        HistorySkipper(min_rollout_share=0.5)


def test_posterior_rule_keeps_by_the_chance_the_next_group_is_informative() -> None:
    """``rule="posterior"``: ``p = max(floor, 1 - E[q^G + (1-q)^G])`` under the prompt's Beta pass-rate
    posterior (checked against numeric integration); more all-pass evidence skips more; rewards
    outside [0, 1] are refused before anything is recorded; the history survives a checkpoint."""
    from grpo_parts.skip.history import zero_variance_probability

    q = torch.linspace(0, 1, 200001, dtype=torch.float64)
    for passes, trials, g in ((7.0, 8.0, 8), (2.0, 4.0, 4), (0.0, 16.0, 8)):
        a, b = 1 + passes, 1 + trials - passes
        dens = q ** (a - 1) * (1 - q) ** (b - 1)
        want = float(torch.trapezoid(dens * (q**g + (1 - q) ** g), q) / torch.trapezoid(dens, q))
        assert zero_variance_probability(passes, trials, g) == pytest.approx(want, rel=1e-6)
    s = HistorySkipper(rule="posterior", min_keep_prob=0.05, base_step=0.0, window=8)
    ones = torch.ones(8)
    gi = torch.zeros(8, dtype=torch.long)
    s.observe([1], ones, gi)
    once = s.inclusion_probability(1)
    s.observe([1], ones, gi)
    twice = s.inclusion_probability(1)
    assert 0.05 <= twice < once < 1.0  # more all-pass evidence: skipped more
    s.observe([2], torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0]), gi)
    assert s.inclusion_probability(2) == 1.0  # its last group had variance
    with pytest.raises(GRPOPartsError, match=r"^rewards: rule='posterior' reads rewards in \[0, 1\]"):
        s.observe([3], torch.full((8,), 2.0), gi)
    assert s.record(3) is None
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    back = HistorySkipper(rule="posterior", min_keep_prob=0.05, base_step=0.0, window=8)
    back.load_state_dict(torch.load(buf, weights_only=True))
    assert back.inclusion_probability(1) == pytest.approx(twice)


def test_a_framework_door_not_asked_to_skip_says_it_is_opt_in(caplog: pytest.LogCaptureFixture) -> None:
    """verl and OpenRLHF build their stage through ``checked_skipper``: ``none`` logs one line naming
    the switch and what this run would refuse; a skipper that never skips says nothing."""
    from grpo_parts.build import build_prompt_skipper
    from grpo_parts.skip.stage import checked_skipper

    with caplog.at_level("INFO", logger="grpo_parts.skip.stage"):
        for name, kwargs in (("none", {}), ("history", {"min_keep_prob": 1.0})):
            assert checked_skipper(
                build_prompt_skipper(name, kwargs=kwargs), door="verl", setting="grpo_parts.prompt_skip",
                reasons=lambda: ["loss.agg='token-mean': divides by ...; expected ..."],
            ) is None  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "grpo_parts: prompt skipping is opt-in (grpo_parts.prompt_skip=history turns it on); this run "
        "would refuse it: "
        "loss.agg='token-mean': divides by ...; expected ..."
    )
