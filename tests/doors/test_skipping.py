"""The prompt-skip stage's skipper behind a framework door (``grpo_parts.doors.skipping``): built by
name, refused in one line naming the door's switch, or None where it never skips."""

from __future__ import annotations

import pytest

from grpo_parts.doors.skipping import build_skipper
from grpo_parts.errors import NotSupportedError
from grpo_parts.skip.history import HistorySkipper


def _build(spec: str, kwargs: dict[str, object] | None, reasons: list[str]) -> object:
    return build_skipper(spec, kwargs, door="verl", setting="grpo_parts.prompt_skip", reasons=lambda: reasons)


def test_history_is_built_and_none_is_off() -> None:
    assert isinstance(_build("history", None, []), HistorySkipper)
    assert _build("none", None, ["anything"]) is None
    assert _build("history", {"min_keep_prob": 1.0}, []) is None  # never skips


def test_refusals_name_the_switch_in_one_line() -> None:
    with pytest.raises(NotSupportedError, match=r"^grpo_parts.prompt_skip='history' cannot run here: loss"):
        _build("history", None, ["loss: depends on the draw"])
    with pytest.raises(
        NotSupportedError, match="step_size='fewer': verl trains whole steps.*expected 'fill'"
    ):
        _build("history", {"step_size": "fewer"}, [])
