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
* vLLM engines: :class:`LocalEngine` hosts the launcher's rollout actor class
  (:class:`~grpo_parts_adapters.openrlhf.rollout.RolloutParts`, which for a grpo_parts agent
  executor has no vLLM behind it) on its own event-loop thread, as Ray hosts an async actor.
* Weight sync: OpenRLHF's ``ActorPPOTrainer._init_vllm_sync_group`` and ``broadcast_to_vllm`` run
  as shipped (:func:`init_sync_group`, :func:`broadcast`) with two names of theirs bound in a
  private scope: vLLM's ``stateless_init_process_group`` (PyNccl, CUDA) -> :class:`GlooGroup`, the
  same ``broadcast(tensor, src, stream)`` over gloo, and ``ray`` -> :data:`RAY_SHIM`, whose ``get``
  waits for the futures the hosted engine returns (the engine receives while the actor sends, so
  those calls cannot be answered with finished ``ray.put`` references).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

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
    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]  # PyNccl's stream argument
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


def fail_rank(results: dict[str, Any], key: str, out: Path, rank: int) -> NoReturn:
    """Record the exception being handled under ``results["errors"][key]``, save what this rank has
    and exit at once: the other rank's next collective then fails too, instead of hanging."""
    results["errors"][key] = traceback.format_exc()
    print(results["errors"][key], flush=True)
    torch.save(results, out / f"rank{rank}.pt")
    os._exit(1)


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


class GlooGroup:
    """vLLM's PyNccl communicator as OpenRLHF's weight sync uses it (``broadcast(tensor, src,
    stream)``), over a gloo group of its own (``host:port`` store, served by rank 0)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: Any = None):
        timeout = datetime.timedelta(seconds=120)
        store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.pg = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.pg.broadcast(tensor, src).wait()  # type: ignore[attr-defined]  # (the C++ class has it)


class _RayShim:
    """``ray`` for OpenRLHF's weight-sync code talking to engines hosted here."""

    _private = SimpleNamespace(services=SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))

    @staticmethod
    def get(refs: Any) -> Any:
        import ray

        one = not isinstance(refs, list)
        out = [
            r.result(timeout=300) if isinstance(r, Future) else ray.get(r) for r in ([refs] if one else refs)
        ]
        return out[0] if one else out


RAY_SHIM = _RayShim()


def init_sync_group(trainer: Any, engines: list[Any]) -> None:
    """OpenRLHF's ``_init_vllm_sync_group`` between ``trainer`` (an ``ActorPPOTrainer``, rank 0)
    and ``engines``, as ``ActorPPOTrainer.__init__`` runs it when given engines."""
    from grpo_parts_adapters.openrlhf._scoped import with_globals
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    trainer.vllm_engines, trainer.use_cuda_ipc = engines, False
    init = with_globals(
        ActorPPOTrainer._init_vllm_sync_group, ray=RAY_SHIM, stateless_init_process_group=GlooGroup
    )
    init(trainer, "gloo")


def broadcast(trainer: Any) -> None:
    """OpenRLHF's ``ActorPPOTrainer.broadcast_to_vllm``, as shipped."""
    from grpo_parts_adapters.openrlhf._scoped import with_globals
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    with_globals(ActorPPOTrainer.broadcast_to_vllm, ray=RAY_SHIM)(trainer)


class LocalGroup:
    """``RayActorGroup``'s interface over model actors living in this process (one rank)."""

    def __init__(self, *actors: Any):
        self.actors = actors
        self.calls: list[str] = []

    def async_run_method(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        self.calls.append(method_name)
        if method_name == "broadcast_to_vllm":  # OpenRLHF's, over gloo (see the module docstring)
            for a in self.actors:
                broadcast(a.trainer)
            return [ray.put(None) for _ in self.actors]
        return [ray.put(getattr(a, method_name)(*args, **kwargs)) for a in self.actors]

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        import ray

        self.calls.append(method_name)
        n = len(next(iter(kwargs.values())))
        return [ray.put(a.execute_batch(method_name, kwargs, 0, n)) for a in self.actors]


def cpu_rollout_class() -> Any:
    """The launcher's rollout actor class, its weight receiver on :class:`GlooGroup`."""
    from grpo_parts_adapters.openrlhf.rollout import RolloutParts, WeightReceiver

    class GlooReceiver(WeightReceiver):
        def stateless_group(self, master_address: str, master_port: int, rank: int, world_size: int) -> Any:
            return GlooGroup(master_address, master_port, rank, world_size)

    class CPURolloutParts(RolloutParts):
        receiver_class = GlooReceiver

    return CPURolloutParts


#: engine calls OpenRLHF's ActorPPOTrainer makes around its broadcast: answered with futures
SYNC_CALLS = frozenset(
    {"init_process_group", "update_weight", "update_weight_cuda_ipc", "reset_prefix_cache"}
)


class LocalEngine:
    """A rollout actor (:func:`cpu_rollout_class`) on its own event-loop thread, as Ray runs an
    async actor: ``engine.<method>.remote(...)`` runs the method there and returns a ``ray.put``
    reference of its result, or (:data:`SYNC_CALLS`) a future :data:`RAY_SHIM` waits for."""

    def __init__(self, agent_func_path: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        cls = cpu_rollout_class()
        self.actor = cls.__new__(cls)
        self.run(self.actor.__init__(agent_func_path=agent_func_path, tensor_parallel_size=1)).result()
        self.executor = self.actor.executor
        self.calls: list[str] = []

    def run(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __getattr__(self, name: str) -> Any:
        actor = self.__dict__.get("actor")
        if name.startswith("_") or actor is None or not callable(getattr(actor, name, None)):
            raise AttributeError(name)
        return _Remote(self, name)


class _Remote:
    def __init__(self, engine: LocalEngine, name: str):
        self.engine, self.name = engine, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import ray

        self.engine.calls.append(self.name)
        method = getattr(self.engine.actor, self.name)

        async def call() -> Any:
            out = method(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) else out

        fut = self.engine.run(call())
        return fut if self.name in SYNC_CALLS else ray.put(fut.result(timeout=600))
