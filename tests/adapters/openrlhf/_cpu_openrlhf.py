"""OpenRLHF 0.11.2's own training step on CPU, for the subprocess ``_ds_worker.py`` (this module
changes process-wide state -- a gloo process group, CPU stand-ins for CUDA calls -- so the test
process never imports it).

What is real: DeepSpeed (ZeRO-2 engine, its optimizer and scheduler) on a one-rank gloo process
group; OpenRLHF's ``DeepspeedStrategy`` (``prepare``, ``backward``, ``optimizer_step``), its model
actors' ``init_model_from_pretrained`` / ``forward`` / ``append`` / ``fit``, ``ActorPPOTrainer``,
``PPOTrainer`` (its ``__init__``, ``fit`` loop and ``train_step``), ``RemoteExperienceMaker.make_experience``,
``SamplesGenerator``'s vLLM dispatch, the prompt data set and data loader, and Ray's object store
(``ray.put`` / ``ray.get`` / ``ray.wait``) where OpenRLHF's trainer uses it.

What stands in, and why:

* CUDA: OpenRLHF names CUDA devices directly (``torch.cuda.current_device()`` for tensors,
  ``torch.cuda.synchronize()`` after barriers). :func:`setup_process` makes ``current_device``
  answer ``"cpu"`` (``0`` while a replay buffer is constructed, which only formats it into a
  device name) and ``synchronize`` a no-op. :class:`CPUStrategy` builds the device mesh on CPU
  (``setup_distributed`` is the only method it replaces) and asks DeepSpeed for torch's AdamW
  (``torch_adam``) instead of FusedAdam, a C++ JIT build of ~90 s on 2 cores; DeepSpeed's
  shared-memory collective op (another JIT build, unused at world size 1) is switched off.
* Ray actors: OpenRLHF's model actors need a GPU to start (``init_device_mesh("cuda")``, NCCL), and
  Ray 2.60 removed local mode, so :class:`LocalGroup` hosts the model actors in this process and
  answers ``RayActorGroup``'s two calls with real ``ray.put`` references.
* vLLM: :class:`LocalEngine` answers the engine calls ``SamplesGenerator`` makes, running
  OpenRLHF's ``RolloutRayActor.generate_responses`` with the agent executor from
  ``--train.agent_func_path`` (as the engine does) and no vLLM behind it.
  ``broadcast_to_vllm`` is not run (NCCL / CUDA IPC); the executor samples from its own model copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

_CURRENT_DEVICE: list[Any] = ["cpu"]


def setup_process(port: int | None) -> None:
    """Stand-ins for flash_attn / vllm, CUDA calls answered for CPU, a gloo group: one rank, or
    (``port=None``) the ranks the environment names (``RANK``, ``WORLD_SIZE``, ``MASTER_*``)."""
    from _openrlhf_standins import install

    if port is not None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    install()
    torch.cuda.current_device = lambda: _CURRENT_DEVICE[0]  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


@contextlib.contextmanager
def cuda_index_zero() -> Iterator[None]:
    """While OpenRLHF constructs a replay buffer (``torch.device(f"cuda:{current_device()}")``,
    never used on this path)."""
    _CURRENT_DEVICE[0] = 0
    try:
        yield
    finally:
        _CURRENT_DEVICE[0] = "cpu"


def cpu_strategy_class() -> type:
    import torch.distributed as dist
    import transformers
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from torch.distributed.device_mesh import init_device_mesh

    class CPUStrategy(DeepspeedStrategy):
        """OpenRLHF's strategy with the device mesh on CPU and torch's AdamW inside DeepSpeed."""

        def setup_distributed(self, timeout: Any = None) -> None:
            transformers.set_seed(self.seed)
            self.world_size = dist.get_world_size()
            dp = self.world_size // self.ring_attn_size // self.ds_tensor_parallel_size
            self.ds_device_mesh = init_device_mesh(
                "cpu",
                (dp, self.ring_attn_size, self.ds_tensor_parallel_size),
                mesh_dim_names=("dp", "sp", "tp"),
            )
            self.setup_ring_attn(self.ds_device_mesh)
            self.accumulated_gradient = (
                self.train_batch_size
                * self.ring_attn_size
                * self.ds_tensor_parallel_size
                // self.micro_train_batch_size
                // self.world_size
            )

        def get_ds_train_config(self, optim_dict: Any = None, *, max_norm: Any = None) -> dict:
            config = super().get_ds_train_config(optim_dict, max_norm=max_norm)
            if "optimizer" in config:
                config["optimizer"]["params"]["torch_adam"] = True
            return config

    return CPUStrategy


def make_strategy(args: Any) -> Any:
    """As ``openrlhf.utils.get_strategy`` builds it, then set up (as the model actors do)."""
    strategy = cpu_strategy_class()(
        seed=args.train.seed,
        full_determinism=args.train.full_determinism_enable,
        max_norm=getattr(args, "max_norm", 1.0),
        micro_train_batch_size=args.train.micro_batch_size,
        train_batch_size=args.train.batch_size,
        zero_stage=args.ds.zero_stage,
        args=args,
    )
    strategy.setup_distributed()
    return strategy


class LocalGroup:
    """``RayActorGroup``'s interface over model actors living in this process (one rank)."""

    def __init__(self, *actors: Any):
        self.actors = actors
        self.calls: list[str] = []

    def async_run_method(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        self.calls.append(method_name)
        if method_name == "broadcast_to_vllm":  # NCCL / CUDA IPC to vLLM workers: nothing to sync here
            return [ray.put(None) for _ in self.actors]
        return [ray.put(getattr(a, method_name)(*args, **kwargs)) for a in self.actors]

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        import ray

        self.calls.append(method_name)
        n = len(next(iter(kwargs.values())))
        return [ray.put(a.execute_batch(method_name, kwargs, 0, n)) for a in self.actors]


class _Remote:
    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.put(self.fn(*args, **kwargs))


class LocalEngine:
    """The calls ``SamplesGenerator`` makes on a vLLM engine (``RolloutRayActor``), answered by
    OpenRLHF's ``generate_responses`` with the agent executor, without vLLM."""

    def __init__(self, agent_func_path: str):
        from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, _load_agent_executor

        self.executor = _load_agent_executor(agent_func_path)
        rollout_cls = RolloutRayActor.__ray_metadata__.modified_class.__ray_actor_class__
        self.calls: list[str] = []

        def generate(**kwargs: Any) -> Any:
            self.calls.append("generate_responses")
            return asyncio.run(rollout_cls.generate_responses(self, **kwargs))

        def record(name: str) -> Any:
            return lambda *a, **k: self.calls.append(name)

        self.generate_responses = _Remote(generate)
        self.get_num_unfinished_requests = _Remote(lambda: 0)
        self.wake_up, self.sleep = _Remote(record("wake_up")), _Remote(record("sleep"))
