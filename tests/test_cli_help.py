"""The CLI's help and the docs tell the truth.

Every option of every command has help; every ``grpo-parts ...`` command named in a help text, an
epilog, README.md or docs/ parses (and passes the train flag checks); the part flags accept exactly
their registry names; ``grpo-parts bench`` alone lists the benchmarks; the main job has one runtime
figure, the same everywhere.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo_parts.cli import BENCHES, build_parser, main
from grpo_parts.train import cli as train_cli

ROOT = Path(__file__).resolve().parents[1]
PARSER = build_parser()


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("grpo-parts",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def test_every_option_of_every_command_has_help() -> None:
    missing = []
    for path, parser in _parsers(PARSER):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                missing += [f"{' '.join(path)} {name}" for name in action.choices if name not in helped]
            elif not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
        assert parser.description, f"{' '.join(path)}: no description"
    assert not missing, f"options without help: {missing}"


# ---------------------------------------------------------------- commands named in help and docs
def _help_texts() -> Iterator[str]:
    for _, parser in _parsers(PARSER):
        yield parser.description or ""
        yield parser.epilog or ""
        for action in parser._actions:
            yield action.help or ""
            for choice in getattr(action, "_choices_actions", []):
                yield choice.help or ""


def _commands_in_prose(text: str) -> Iterator[str]:
    """``grpo-parts ...`` up to the end of its clause: ``.``/``;``/``,``/``)``, a ``#`` comment, or the end
    of an example line (one starting with ``grpo-parts``); wrapped prose lines are joined."""
    ends = [line.split("#")[0].rstrip() + (";" if "#" in line or line.lstrip().startswith("grpo-parts") else "")
            for line in text.splitlines()]  # fmt: skip
    text = " ".join(ends)
    for m in re.finditer(r"grpo-parts\b", text):
        words: list[str] = []
        for word in text[m.end() :].split():
            if word.startswith(("(", "`")) or word == "grpo-parts":
                break
            stripped = word.rstrip(".;,)`")
            if stripped:
                words.append(stripped)
            if stripped != word:
                break
        yield " ".join(words)


def _commands_in_docs() -> Iterator[tuple[str, str]]:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for cmd in re.findall(r"`grpo-parts ([^`:]*)`", text):  # inline; `grpo-parts train: error` is output
            yield path.name, re.sub(r"\[[^\]]*\]", "", cmd).strip()  # [--optional PLACEHOLDER] groups dropped
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for m in re.finditer(r"(?:^|&& )grpo-parts ([^#&]*)", line.strip()):
                    yield path.name, m.group(1).strip()


def _expand(argv: list[str]) -> Iterator[list[str]]:
    """``COMMAND`` / ``BENCH`` placeholders: every subcommand in their place."""
    for i, word in enumerate(argv):
        choices = {"COMMAND": _subcommands(PARSER).choices, "BENCH": BENCHES}.get(word)
        if choices is not None:
            for name in choices:
                yield from _expand([*argv[:i], name, *argv[i + 1 :]])
            return
    yield argv


def _parses(argv: list[str]) -> None:
    try:
        args = PARSER.parse_args(argv)
    except SystemExit as e:  # --help exits 0; an error exits 2
        assert e.code == 0, f"grpo-parts {shlex.join(argv)} does not parse"
        return
    if args.command == "train" or getattr(args, "bench", None) == "e2e":
        train_cli.check_flags(args)


def _named_commands() -> list[tuple[str, str]]:
    found = [("--help", cmd) for text in _help_texts() for cmd in _commands_in_prose(text)]
    return found + list(_commands_in_docs())


def test_help_and_docs_name_commands() -> None:
    sources = {src for src, _ in _named_commands()}
    assert {"--help", "README.md", "training.md", "results.md", "benchmarks-log.md"} <= sources


@pytest.mark.parametrize(("source", "command"), sorted(set(_named_commands())))
def test_every_named_command_parses(source: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in _expand(shlex.split(command)):
        _parses(argv)


# ---------------------------------------------------------------- part flags, bench listing
@pytest.mark.parametrize("part", list(train_cli.PART_FLAGS))
def test_part_flags_accept_exactly_the_registry_names(part: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    names = sorted(importlib.import_module(f"grpo_parts.{part}").IMPLEMENTATIONS)
    train = _subcommands(PARSER).choices["train"]
    (action,) = [a for a in train._actions if f"--{part}" in a.option_strings]
    assert action.help is not None and all(n in action.help for n in names)
    for name in names:
        assert getattr(PARSER.parse_args(["train", f"--{part}", name]), part) == name
    with pytest.raises(SystemExit) as e:
        PARSER.parse_args(["train", f"--{part}", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--{part}" in err and "'nope'" in err and repr(names[0]) in err


def test_bench_alone_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    for name, (_, help_text) in BENCHES.items():
        assert name in out and help_text.split()[0] in out
    assert main([]) == 2
    assert "bench" in capsys.readouterr().out


def test_bench_e2e_help_describes_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--help"])
    out = capsys.readouterr().out
    assert "benchmark" in out and "grpo-parts bench e2e" in out
    assert train_cli.DESCRIPTION.split(":")[0] not in out  # not the training description
    assert "--resume" not in out and "--compare " not in out and "--reference" not in out


def test_bench_bad_list_value_is_a_one_line_parse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "sampler", "--samplers", "reference,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--samplers" in err and "'nope'" in err and "'reference'" in err


# ---------------------------------------------------------------- one runtime figure
def test_main_job_runtime_is_one_figure(capsys: pytest.CaptureFixture[str]) -> None:
    figure = train_cli.MAIN_JOB_RUNTIME
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    readme, training = (ROOT / "README.md").read_text(), (ROOT / "docs" / "training.md").read_text()
    for where, text in (("train --help", help_text), ("README.md", readme), ("docs/training.md", training)):
        assert figure in text, f"{where} does not quote MAIN_JOB_RUNTIME ({figure!r})"
    other = re.compile(r"\b\d[\d.]*\s*(?:s|sec|seconds|min|minutes)\s+on\b|a few minutes on")
    for where, text in (("train --help", help_text), ("README.md", readme)):
        assert not other.findall(text.replace(figure, "")), f"{where} has another runtime figure"
