"""``grpo-parts train`` flags: mapped to TrainConfig, and contradictory combinations refused in one line.

A flag and a ``--set`` naming the same field must agree; ``--reference`` is refused with a part flag,
a ``--set parts.*`` or ``--compare``; ``--json``/``--seeds`` only go with ``--compare``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_parts.cli import build_parser, main
from grpo_parts.errors import GRPOPartsError
from grpo_parts.train.cli import config_from_args
from grpo_parts.train.config import REFERENCE_PARTS

PARSER = build_parser()


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(PARSER.parse_args(["train", *argv]))


def test_flags_map_to_config_fields() -> None:
    cfg = _config("--steps", "3", "--seed", "2", "--group-size", "4", "--lr", "1e-3", "--target", "0.5")
    assert (cfg.steps, cfg.seed, cfg.group_size, cfg.lr, cfg.target_accuracy) == (3, 2, 4, 1e-3, 0.5)
    cfg = _config("--sampler", "reference", "--draft", "none", "--attention", "reference", "--filter", "pods")
    assert (cfg.parts.sampler, cfg.parts.draft, cfg.parts.attention, cfg.parts.filter) == (
        "reference", None, "reference", "pods",
    )  # fmt: skip
    assert _config("--no-progress").progress is False


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "5", "--set", "steps=5"],
        ["--lr", "1e-4", "--set", "lr=1e-4"],  # YAML reads 1e-4 as a string
        ["--lr", "0.0001", "--set", "lr=1.0e-4"],
        ["--model", "./ckpt", "--set", "model=ckpt"],
        ["--sampler", "reference", "--set", "parts.sampler=reference"],
        ["--sampler", "reference", "--set", "parts={sampler: reference}"],
        ["--draft", "none", "--set", "parts.draft=null"],
        ["--steps", "5", "--set", "seed=1"],
    ],
)
def test_a_flag_and_a_set_that_agree_are_fine(argv: list[str]) -> None:
    _config(*argv)


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--steps", "5", "--set", "steps=7"], ["steps: set twice", "--steps 5", "--set steps=7"]),
        (
            ["--sampler", "reference", "--set", "parts.sampler=speculative"],
            ["parts.sampler: set twice", "--sampler reference", "--set parts.sampler=speculative"],
        ),
        (
            ["--sampler", "reference", "--set", "parts={filter: keep_all}"],
            ["parts.sampler", "--sampler reference", "replaces the whole 'parts' section"],
        ),
        (["--group-size", "4", "--set", "group_size=8"], ["group_size", "--group-size 4", "group_size=8"]),
        (["--no-progress", "--set", "progress=true"], ["progress", "--no-progress", "progress=true"]),
        (["--reference", "--sampler", "speculative"], ["--reference", "--sampler speculative", "expected"]),
        (["--reference", "--set", "parts.refill_rounds=3"], ["--reference", "--set parts.refill_rounds=3"]),
        (["--reference", "--set", "parts={}"], ["--reference", "--set parts={}"]),
        (["--reference", "--compare"], ["--reference", "--compare", "expected one of them"]),
        (["--json", "x.json"], ["--json", "only used with --compare"]),
        (["--seeds", "3"], ["--seeds", "only used with --compare"]),
        (["--ablate"], ["--ablate", "only used with --compare"]),
    ],
)
def test_contradictory_flags_are_one_line_errors(argv: list[str], fragments: list[str]) -> None:
    with pytest.raises(GRPOPartsError) as e:
        _config(*argv)
    msg = str(e.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_reference_replaces_the_parts_of_a_config_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("parts: {sampler: speculative, filter: pods}\nsteps: 3\n")
    cfg = _config("--config", str(f), "--reference")
    assert {k: getattr(cfg.parts, k) for k in REFERENCE_PARTS} == REFERENCE_PARTS and cfg.steps == 3


def test_cli_conflict_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--steps", "5", "--set", "steps=7", "--out-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo-parts train: error: steps: set twice")
    assert not any(tmp_path.iterdir())


def test_bench_e2e_takes_the_run_options_but_not_train_only_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = PARSER.parse_args(["bench", "e2e", "--seeds", "2", "--json", "x.json", "--lr", "1e-3"])
    assert args.compare and not args.reference and args.resume is None
    assert config_from_args(args).lr == 1e-3
    for flag in ("--reference", "--compare", "--resume"):
        with pytest.raises(SystemExit):
            PARSER.parse_args(["bench", "e2e", flag])
    with pytest.raises(SystemExit):
        PARSER.parse_args(["train", "--seeds", "0"])
    assert "--seeds" in capsys.readouterr().err
