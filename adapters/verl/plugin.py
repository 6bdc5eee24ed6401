"""verl plugin entry: importing this module registers every grpo_parts part with verl (through the
``verl.plugins`` entry point, ``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib``,
which is too late for ``trainer.v1.trainer_mode``; docs/adapters/verl.md, "Loading the plugin"). A part
whose verl seam cannot be imported is skipped with a warning instead of breaking ``import verl``;
:data:`STATUS` says what happened."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _advantage() -> None:
    from .advantage import register

    register()


def _trainer() -> None:
    from .trainer import register

    register()


def _agent_loop() -> None:
    from .agent_loop import register_agent_loop

    register_agent_loop()


def _rollout_replica() -> type:
    from .rollout import GRPOPartsReplica

    return GRPOPartsReplica


def _rollout() -> None:
    # by name, imported when verl asks for them: .rollout imports verl, whose import loads this plugin
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .options import ROLLOUT_NAME

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _rollout_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__package__}.rollout.GRPOPartsRollout"


def _attention() -> None:
    # the attention part is switched on per engine by config keys (``.config.FSDPActorConfig``),
    # which install the engine hook when verl builds them; here: only check that it can be built
    from . import config  # noqa: F401


#: verl's registries this plugin fills -> the function that registers there
SEAMS: dict[str, Callable[[], None]] = {
    "advantage_estimator": _advantage,
    "trainer": _trainer,
    "agent_loop": _agent_loop,
    "rollout": _rollout,
    "attention_config": _attention,
}


def register_all() -> dict[str, str]:
    """Register every verl seam; returns ``{seam: "registered" | "skipped: <why>"}``."""
    status: dict[str, str] = {}
    for seam, fn in SEAMS.items():
        try:
            fn()
            status[seam] = "registered"
        except ImportError as e:  # a verl seam needs a package that is not installed
            status[seam] = f"skipped: {e}"
            logger.warning("grpo_parts verl plugin: %s not registered (%s)", seam, e)
    return status


STATUS = register_all()
