"""One parts configuration behind every door (issue 43 item 3): each door maps its own spelling into
:class:`grpo_parts.parts_config.PartsConfig`, a shared setting has one name, and the earlier
spellings are read as it (logged) or refused when both are given."""

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


def test_trl_maps_keywords_options_and_parts_into_one_config(caplog: pytest.LogCaptureFixture) -> None:
    from grpo_parts_adapters.trl.options import TRLPartsOptions, trl_parts

    none = dict.fromkeys(["sampler", "draft", "attention", "completion_filter", "prompt_skip"])
    kw = {**none, "filter_kwargs": None}
    config, built = trl_parts(PartsConfig(filter="cppo", refill_rounds=2), kw, TRLPartsOptions())
    assert type(config) is PartsConfig and built["completion_filter"] == "cppo" and built["sampler"] is None
    config, built = trl_parts(None, {**kw, "completion_filter": "dppo"}, TRLPartsOptions())
    assert config.filter == "dppo" and built["completion_filter"] == "dppo"
    # the earlier spellings in TRLPartsOptions are read into the one config, logged
    with caplog.at_level("WARNING"):
        opts = TRLPartsOptions(group_rows=False, filter_remainder="drop", max_refill_rounds=3, refill=True)
    config, _ = trl_parts(None, kw, opts)
    assert (config.group_rows, config.kept_rounding, config.refill_rounds) == (False, "down", 2)
    assert "PartsConfig(kept_rounding='down')" in caplog.text
    with pytest.raises(GRPOPartsError, match="completion_filter: given both"):
        trl_parts(PartsConfig(filter="cppo"), {**kw, "completion_filter": "dppo"}, TRLPartsOptions())
    with pytest.raises(GRPOPartsError, match="parts.refill_rounds: given both"):
        trl_parts(PartsConfig(refill_rounds=1), kw, TRLPartsOptions(refill_rounds=2))


def test_openrlhf_flags_are_the_shared_config() -> None:
    from grpo_parts_adapters.openrlhf.config import FLAGS, OpenRLHFPartsConfig

    assert set(SHARED) <= set(FLAGS)
    cfg = OpenRLHFPartsConfig(filter="cppo", kept_rounding="down", group_rows="off", attention="none")
    assert isinstance(cfg, PartsConfig) and (cfg.group_rows, cfg.attention) == (False, None)
    assert OpenRLHFPartsConfig(filter_rounding="down").kept_rounding == "down"  # earlier flag name
    with pytest.raises(ValueError, match="give --grpo_parts.kept_rounding only"):
        OpenRLHFPartsConfig(filter_rounding="down", kept_rounding="up")


def test_verl_options_map_into_the_shared_config() -> None:
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.options import EngineOptions

    parts = FilterOptions(name="cppo", kwargs={"k": 4}, refill_rounds=1, rounding="down").parts
    assert type(parts) is PartsConfig
    assert (parts.filter, parts.filter_kwargs, parts.refill_rounds, parts.kept_rounding) == (
        "cppo", {"k": 4}, 1, "down"
    )  # fmt: skip
    engine = EngineOptions(attention="shared_prefix", kernel="sdpa").parts
    assert engine.attention == "shared_prefix" and engine.attention_kwargs["kernel"] == "sdpa"
    assert EngineOptions().parts.attention is None
