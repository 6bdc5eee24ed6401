"""Launch OpenRLHF's GRPO with grpo_parts: ``python -m grpo_parts_adapters.openrlhf.launch [flags]``.
Every flag of ``openrlhf.cli.train_ppo_ray`` works unchanged, plus ``--grpo_parts.*`` (:data:`.config.FLAGS`).
The script runs with *its own* imports resolving to the grpo_parts subclasses (:mod:`._scoped`), so nothing
else in the process or in Ray's workers sees a change; with every flag at its default the run is plain
OpenRLHF GRPO. docs/adapters/openrlhf.md, "Launch"."""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

from grpo_parts.errors import GRPOPartsError, NotSupportedError

from ._scoped import run_entry_script
from .config import ADVANTAGE_CONFIGS, FLAGS, OpenRLHFPartsConfig, skip_reasons, weighted_filter_reasons

OPENRLHF_MAIN = "openrlhf.cli.train_ppo_ray"
PROG = "python -m grpo_parts_adapters.openrlhf.launch"
#: modules OpenRLHF 0.11.2's entry script imports at top level, with the names it takes from them
TOP_LEVEL = ("openrlhf.trainer.ray", "openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ray.launcher")


def add_parts_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--grpo_parts.*`` group (dotted dests, so OpenRLHF's ``hierarchize`` nests them)."""
    group = parser.add_argument_group("grpo_parts", "grpo_parts accelerators (docs/adapters/openrlhf.md)")
    for name, (typ, default, help_) in FLAGS.items():
        group.add_argument(f"--grpo_parts.{name}", type=typ, default=default, help=help_)


def parts_from_namespace(ns: argparse.Namespace) -> OpenRLHFPartsConfig:
    given = {k.split(".", 1)[1]: v for k, v in vars(ns).items() if k.startswith("grpo_parts.")}
    return OpenRLHFPartsConfig(**{k: v for k, v in given.items() if v is not None})


def check_supported(ns: argparse.Namespace, parts: OpenRLHFPartsConfig) -> None:
    if getattr(ns, "train.async_enable", False) and parts != OpenRLHFPartsConfig():
        raise GRPOPartsError(
            "--train.async_enable: OpenRLHF's async trainer is not wired to grpo_parts yet; "
            "run synchronously or keep every --grpo_parts.* flag at its default"
        )
    est = getattr(ns, "algo.advantage.estimator", "group_norm")
    for flag, on in (("filter", parts.filter != "keep_all"), ("prompt_skip", parts.prompt_skip != "none")):
        if on and est not in ADVANTAGE_CONFIGS:
            raise GRPOPartsError(
                f"--grpo_parts.{flag} needs --algo.advantage.estimator one of {', '.join(ADVANTAGE_CONFIGS)}, "
                f"got {est!r}"
            )
    if parts.prompt_skip == "none" and parts.filter == "keep_all":
        return
    # what cannot stay unbiased is refused here in one line, not in a Ray actor
    from openrlhf.utils.config import hierarchize

    args = hierarchize(ns)
    if parts.prompt_skip != "none":
        reasons = skip_reasons(args, parts.refill_rounds)
        if reasons:
            raise NotSupportedError(f"--grpo_parts.prompt_skip {parts.prompt_skip}", reasons)
    if parts.filter != "keep_all":  # a weighted filter (dppo)
        filt = parts.build_filter()
        reasons = weighted_filter_reasons(filt, args, parts.refill_rounds)
        if reasons:
            raise NotSupportedError(f"--grpo_parts.filter {filt.name}", reasons)


class _Run:
    """One launch: its argv, the parsed parts config, the module views the script imported."""

    def __init__(self, argv: Sequence[str]):
        self.argv = list(argv)
        self.parts: OpenRLHFPartsConfig | None = None
        self.views: dict[str, types.ModuleType] = {}


def _parser_class(run: _Run) -> type[argparse.ArgumentParser]:
    class GRPOPartsArgumentParser(argparse.ArgumentParser):
        """What the script's ``argparse.ArgumentParser()`` builds: OpenRLHF's parser plus the
        ``grpo_parts`` group, parsing this launch's argv (``sys.argv`` is not read or changed)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("prog", PROG)
            super().__init__(*args, **kwargs)
            add_parts_flags(self)

        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
            missing = [m for m in TOP_LEVEL if m not in run.views]
            if missing:
                raise GRPOPartsError(
                    f"{OPENRLHF_MAIN} did not import {missing}: this launcher supports OpenRLHF 0.11.2's entry script"
                )
            ns = super().parse_args(run.argv if args is None else args, namespace)
            run.parts = parts_from_namespace(ns)
            check_supported(ns, run.parts)
            return ns

    return GRPOPartsArgumentParser


def _create_engines(run: _Run) -> Any:
    def create_vllm_engines(*args: Any, **kwargs: Any) -> Any:
        from .vllm_spec import create_vllm_engines_with

        return create_vllm_engines_with(run.parts or OpenRLHFPartsConfig())(*args, **kwargs)

    return create_vllm_engines


def overrides(run: _Run) -> dict[str, dict[str, Any]]:
    """What the entry script's imports resolve to in this launch (module -> name -> object)."""
    from .ray_actors import GRPOPartsPolicyModelActor, GRPOPartsPPOTrainer, GRPOPartsReferenceModelActor

    return {
        "argparse": {"ArgumentParser": _parser_class(run)},
        "openrlhf.trainer.ray": {"create_vllm_engines": _create_engines(run)},
        "openrlhf.trainer.ray.ppo_actor": {"PolicyModelActor": GRPOPartsPolicyModelActor},
        "openrlhf.trainer.ray.launcher": {"ReferenceModelActor": GRPOPartsReferenceModelActor},
        "openrlhf.trainer.ppo_trainer": {"PPOTrainer": GRPOPartsPPOTrainer},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run OpenRLHF's ``train_ppo_ray`` with grpo_parts (``argv`` defaults to ``sys.argv[1:]``)."""
    run = _Run(sys.argv[1:] if argv is None else argv)
    run_entry_script(OPENRLHF_MAIN, overrides(run), run.views)
    return 0


class _Parsed(Exception):
    def __init__(self, args: Any):
        super().__init__("parsed")
        self.openrlhf_args = args


def parse_args(argv: Sequence[str]) -> tuple[Any, OpenRLHFPartsConfig]:
    """OpenRLHF's hierarchized, validated ``args`` for ``argv`` (its parser and checks as shipped,
    plus the ``grpo_parts`` group) and the parts config, without starting Ray or training: the
    entry script runs until ``train()`` asks for the strategy."""

    def stop(args: Any) -> NoReturn:
        raise _Parsed(args)

    run = _Run(argv)
    scoped = overrides(run)
    scoped["ray"] = {"is_initialized": lambda: True}
    scoped["openrlhf.utils"] = {"get_strategy": stop}
    try:
        run_entry_script(OPENRLHF_MAIN, scoped, run.views)
    except _Parsed as parsed:
        return parsed.openrlhf_args, OpenRLHFPartsConfig.from_args(parsed.openrlhf_args)
    raise GRPOPartsError(f"{OPENRLHF_MAIN} returned without calling get_strategy(args)")


if __name__ == "__main__":
    raise SystemExit(main())
