"""One-completion requests regrouped into a sampler's prompt groups (``grpo_parts.doors.grouping``)."""

from __future__ import annotations

from grpo_parts.doors.grouping import identical_prompt_groups


def test_equal_repeats_become_groups_and_rows_map_back() -> None:
    unique, g, rows = identical_prompt_groups([[1, 2], [3], [1, 2], [3]])
    assert (unique, g) == ([[1, 2], [3]], 2)
    assert rows == [0, 2, 1, 3]  # the sampler's prompt-major rows -> the request each answers


def test_unequal_repeats_stay_single_requests() -> None:
    prompts = [[1], [1], [2]]
    assert identical_prompt_groups(prompts) == (prompts, 1, [0, 1, 2])
