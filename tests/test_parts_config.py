"""One parts configuration behind every door (issue 43 item 3): each door maps its own spelling into
:class:`grpo_parts.parts_config.PartsConfig`, a shared setting has one name, and any other name
(a misspelt or an earlier one) is refused in one line naming it and the valid ones."""

from __future__ import annotations

import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.parts_config import DOOR_DEFAULTS, PartsConfig

SHARED = ("refill_rounds", "kept_rounding", "group_rows")


def test_train_reads_the_shared_config_with_its_own_defaults() -> None:
    from grpo_parts.train.config import load_config

    cfg = load_config(sets=["parts.filter=dppo", "parts.kept_rounding=down", "parts.refill_rounds=0"])
    assert type(cfg.parts) is PartsConfig
    assert (cfg.parts.filter, cfg.parts.kept_rounding) == ("dppo", "down")
    assert cfg.parts.sampler == DOOR_DEFAULTS["train"]["sampler"]  # unset: this door's default
    assert load_config().parts == PartsConfig.for_door("train")
    with pytest.raises(GRPOPartsError, match="parts.group_rows"):
        load_config(sets=["parts.group_rows=false"])


def test_trl_maps_keywords_and_parts_into_one_config() -> None:
    from grpo_parts_adapters.trl.options import PART_KEYWORDS, trl_parts

    assert set(PART_KEYWORDS) <= set(PartsConfig.model_fields)  # the keywords are the config's names
    config, built = trl_parts(PartsConfig(filter="cppo", refill_rounds=2), {})
    assert type(config) is PartsConfig and built["filter"] == "cppo" and built["sampler"] is None
    config, built = trl_parts(None, {"filter": "dppo"})
    assert config.filter == "dppo" and built["filter"] == "dppo"
    with pytest.raises(GRPOPartsError, match="filter: given both"):
        trl_parts(PartsConfig(filter="cppo"), {"filter": "dppo"})


@pytest.mark.parametrize(
    ("door", "old"),
    [
        ("trl", {"filter_remainder": "drop"}),
        ("trl", {"refill_rounds": 2}),
        ("verl", {"rounding": "down"}),
        ("verl", {"max_rounds": 3}),
        ("verl-engine", {"merge_slack": 0.25}),
        ("openrlhf", {"filter_rounding": "down"}),
        ("openrlhf", {"grouped_microbatches": "on"}),
    ],
)
def test_an_old_spelling_is_an_unknown_field(door: str, old: dict[str, object]) -> None:
    """Nothing released, nothing old read: the ordinary one-line error naming the field and the valid ones."""
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.trl.options import TRLPartsOptions
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.options import EngineOptions

    cls = {
        "trl": TRLPartsOptions,
        "verl": FilterOptions,
        "verl-engine": EngineOptions,
        "openrlhf": OpenRLHFPartsConfig,
    }
    (name,) = old
    with pytest.raises(ValueError, match=rf"{name}: unknown field; expected one of \[.*'\w+'.*\]"):
        cls[door](**old)


def test_openrlhf_flags_are_the_shared_config() -> None:
    from grpo_parts_adapters.openrlhf.config import FLAGS, OpenRLHFPartsConfig

    assert set(SHARED) <= set(FLAGS)
    cfg = OpenRLHFPartsConfig(filter="cppo", kept_rounding="down", group_rows="off", attention="none")
    assert isinstance(cfg, PartsConfig) and (cfg.group_rows, cfg.attention) == (False, None)
    assert OpenRLHFPartsConfig(attention="reference").attention == "reference"  # one meaning everywhere


def test_verl_options_map_into_the_shared_config() -> None:
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.options import EngineOptions

    parts = FilterOptions(name="cppo", kwargs={"k": 4}, refill_rounds=1, kept_rounding="down").parts
    assert type(parts) is PartsConfig
    assert (parts.filter, parts.filter_kwargs, parts.refill_rounds, parts.kept_rounding) == (
        "cppo", {"k": 4}, 1, "down"
    )  # fmt: skip
    engine = EngineOptions(attention="shared_prefix", kernel="sdpa").parts
    assert engine.attention == "shared_prefix" and engine.attention_kwargs["kernel"] == "sdpa"
    assert EngineOptions().parts.attention is None
