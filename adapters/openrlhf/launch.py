"""Launch OpenRLHF's GRPO with grpo_parts: ``python -m grpo_parts_adapters.openrlhf.launch [flags]``.

Every OpenRLHF flag of ``openrlhf.cli.train_ppo_ray`` works unchanged (its parser, validation and
``train()`` run as shipped), plus ``--grpo_parts.*`` (see ``--help`` and :data:`.config.FLAGS`).
For the duration of the run, and only in this (driver) process, the launcher points OpenRLHF's
module attributes ``PolicyModelActor``, ``ReferenceModelActor``, ``PPOTrainer`` and
``create_vllm_engines`` at the grpo_parts subclasses (:mod:`.ray_actors`, :mod:`.vllm_spec`);
Ray ships those classes to the workers, and the parts config travels in ``strategy.args``.
With every ``--grpo_parts.*`` flag at its default the run is plain OpenRLHF GRPO.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from grpo_parts.errors import GRPOPartsError

from .config import FLAGS, PartsConfig

OPENRLHF_MAIN = "openrlhf.cli.train_ppo_ray"


def add_parts_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--grpo_parts.*`` group (dotted dests, so OpenRLHF's ``hierarchize`` nests them)."""
    group = parser.add_argument_group("grpo_parts", "grpo_parts accelerators (docs/adapters/openrlhf.md)")
    for name, (typ, default, help_) in FLAGS.items():
        group.add_argument(f"--grpo_parts.{name}", type=typ, default=default, help=help_)


def parts_from_namespace(ns: argparse.Namespace) -> PartsConfig:
    return PartsConfig(**{k.split(".", 1)[1]: v for k, v in vars(ns).items() if k.startswith("grpo_parts.")})


def check_supported(ns: argparse.Namespace, parts: PartsConfig) -> None:
    if getattr(ns, "train.async_enable", False) and parts != PartsConfig():
        raise GRPOPartsError(
            "--train.async_enable: OpenRLHF's async trainer is not wired to grpo_parts yet; "
            "run synchronously or keep every --grpo_parts.* flag at its default"
        )
    est = getattr(ns, "algo.advantage.estimator", "group_norm")
    if parts.filter != "keep_all" and est not in ("group_norm", "dr_grpo", "rloo"):
        raise GRPOPartsError(
            f"--grpo_parts.filter needs --algo.advantage.estimator group_norm, dr_grpo or rloo, got {est!r}"
        )


class _Run:
    """State of one launch in the driver: the parsed parts config, set by the parse hook."""

    parts: PartsConfig | None = None


@contextlib.contextmanager
def _parse_hook(run: _Run) -> Iterator[None]:
    """Add our flags to the first parser OpenRLHF's main builds, and validate them after parsing."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        if run.parts is None and not any(a.dest.startswith("grpo_parts.") for a in self._actions):
            add_parts_flags(self)
        ns = original(self, args, namespace)
        run.parts = parts_from_namespace(ns)
        check_supported(ns, run.parts)
        return ns

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _swapped(attrs: dict[tuple[str, str], Any]) -> Iterator[None]:
    saved = {}
    for (mod, name), value in attrs.items():
        m = importlib.import_module(mod)
        saved[(m, name)] = getattr(m, name)
        setattr(m, name, value)
    try:
        yield
    finally:
        for (m, name), value in saved.items():
            setattr(m, name, value)


def _create_engines(run: _Run) -> Any:
    def create(*args: Any, **kwargs: Any) -> Any:
        from .vllm_spec import create_vllm_engines_with

        return create_vllm_engines_with(run.parts or PartsConfig())(*args, **kwargs)

    return create


def main(argv: Sequence[str] | None = None) -> int:
    from .ray_actors import GRPOPartsPolicyModelActor, GRPOPartsPPOTrainer, GRPOPartsReferenceModelActor

    run = _Run()
    swaps = {
        ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor"): GRPOPartsPolicyModelActor,
        ("openrlhf.trainer.ray.launcher", "ReferenceModelActor"): GRPOPartsReferenceModelActor,
        ("openrlhf.trainer.ppo_trainer", "PPOTrainer"): GRPOPartsPPOTrainer,
        ("openrlhf.trainer.ray", "create_vllm_engines"): _create_engines(run),
    }
    saved_argv = sys.argv
    sys.argv = [OPENRLHF_MAIN, *(sys.argv[1:] if argv is None else argv)]
    try:
        with _parse_hook(run), _swapped(swaps):
            runpy.run_module(OPENRLHF_MAIN, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved_argv
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
