"""One name per counter (issue 43 item 3): the trainer writes it bare, every framework door adds
``parts/<part>/`` and nothing else -- checked against the keys the doors' code writes."""

from __future__ import annotations

import re
from pathlib import Path

from grpo_parts.counters import PART_OF, WEIGHTED_ROWS, door_key

ROOT = Path(__file__).resolve().parents[1]


def test_each_door_only_adds_its_prefix() -> None:
    assert door_key("train", WEIGHTED_ROWS) == "weighted_rows"
    for door in ("trl", "verl", "openrlhf"):
        assert door_key(door, WEIGHTED_ROWS) == "parts/filter/weighted_rows"
    assert all(door_key("trl", name).endswith("/" + name) for name in PART_OF)


def test_no_adapter_writes_a_second_prefix() -> None:
    """Every metric key an adapter writes starts with ``parts/`` (no ``grpo_parts/...`` second spelling)."""
    bad = []
    for path in (ROOT / "adapters").rglob("*.py"):
        for m in re.finditer(r"[\"'](grpo_parts/[a-z_]+/)", path.read_text()):
            bad.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert not bad, bad


def test_no_adapter_spells_a_counter_key_itself() -> None:
    """Every ``parts/...`` key an adapter writes comes from :mod:`grpo_parts.counters` (one name each)."""
    bad = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in (ROOT / "adapters").rglob("*.py")
        for m in re.finditer(r"f?[\"']parts/", path.read_text())
    ]
    assert not bad, bad
