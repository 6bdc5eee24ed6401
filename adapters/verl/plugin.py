"""verl plugin entry: importing this module registers every grpo_parts part with verl.

verl imports it through any of its own mechanisms:

* the ``verl.plugins`` entry point this package installs (loaded by ``import verl`` in every
  process, Ray workers included; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns discovery off);
* ``VERL_USE_EXTERNAL_MODULES=grpo_parts_adapters.verl.plugin``;
* ``actor_rollout_ref.model.external_lib=grpo_parts_adapters.verl.plugin`` (imported when the
  model config is built: enough for the estimator and agent loop, but too late for
  ``trainer.v1.trainer_mode``, which is looked up first -- use one of the two above for that).

The shared-prefix attention part needs no registration: the config keys of
:mod:`grpo_parts_adapters.verl.config` switch it on per engine (``_target_`` names our config class,
which Hydra imports).

Registering is the point of this module, so it happens on import; each part is registered on its
own and a part whose verl seam cannot be imported (e.g. no TransferQueue for the v1 trainer) is
skipped with a warning instead of breaking ``import verl``. :data:`STATUS` says what happened.
"""

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
