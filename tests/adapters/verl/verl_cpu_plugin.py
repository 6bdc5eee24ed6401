"""Test-only verl plugin that makes verl 0.9.1's trainer run on a CPU box (it registers no CPU
platform): loaded in *every* process of a test's ``python -m verl.trainer.main_ppo`` run (driver and
Ray workers) through ``VERL_USE_EXTERNAL_MODULES``, with ``VERL_PLATFORM=cpu``.

It registers the CPU platform of :mod:`_cpu_verl` and applies, process-wide *in that run's
processes only*, the same CPU shims the engine tests apply inside ``verl_on_cpu()``. The product
(grpo_parts_adapters) never imports this module and patches nothing of verl.
"""

from __future__ import annotations

from _cpu_verl import CPUPlatform
from verl.plugin.platform import PlatformRegistry


class TrainerCPUPlatform(CPUPlatform):
    """Workers are placed on a *logical* GPU (the run starts Ray with ``num_gpus=1``): verl's resource
    pools count GPUs before placing the actor, reference and rollout workers."""

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {"num_gpus": num_gpus}


# registered before anything asks verl for its platform (transformer_impl reads it on import)
PlatformRegistry.register(platform="cpu")(TrainerCPUPlatform)

import torch.distributed.fsdp._init_utils as fsdp1_init  # noqa: E402
import verl.models.transformers.monkey_patch as mp  # noqa: E402
import verl.workers.engine.fsdp.transformer_impl as ti  # noqa: E402

ti.device_name = "cpu"
mp.is_trl_available = lambda: False
fsdp1_init._check_module_states_for_sync_module_states = lambda states: None
_offload = ti.CPUOffloadPolicy
ti.CPUOffloadPolicy = lambda pin_memory=True: _offload(pin_memory=False)

import verl.utils.distributed as vdist  # noqa: E402

_init_pg = vdist.initialize_global_process_group_ray


def _init_pg_gloo(timeout_second=None, backend=None):  # type: ignore[no-untyped-def]
    # verl builds "cpu:gloo,<device>:<nccl>"; with device "cpu" that names cpu twice
    return _init_pg(timeout_second=timeout_second, backend=backend or "gloo")


vdist.initialize_global_process_group_ray = _init_pg_gloo
