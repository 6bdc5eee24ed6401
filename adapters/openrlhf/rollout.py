"""The rollout actor the launcher builds for an agent file, so that OpenRLHF's weight broadcast reaches a
grpo_parts sampler: ``broadcast_to_vllm`` sends each updated parameter to the vLLM workers, not to the
engine actor where the agent executor lives. For :class:`~.agent.GRPOPartsAgentExecutor`,
:class:`RolloutParts` starts no vLLM engine and takes the vLLM worker's rank in the sync group itself
(:class:`WeightReceiver`), loading the whole stream into the executor's policy copy; any other executor
gets OpenRLHF's engine. docs/adapters/openrlhf.md, "Sampler"."""

from __future__ import annotations

from typing import Any

import ray
import torch
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, _load_agent_executor

from grpo_parts.errors import GRPOPartsError

from ._scoped import with_globals
from .agent import GRPOPartsAgentExecutor

#: OpenRLHF's class behind its ``@ray.remote`` wrapper (Ray forbids subclassing the wrapper)
_Rollout = RolloutRayActor.__ray_metadata__.modified_class.__ray_actor_class__


class WeightReceiver:
    """The vLLM worker's end of OpenRLHF's weight-sync group, for an executor's policy copy."""

    def __init__(self, executor: GRPOPartsAgentExecutor) -> None:
        self.executor = executor
        self.group: Any = None  # a ray.util.collective group name, or the stateless communicator
        self.use_ray = False
        self.pending: list[tuple[str, torch.Tensor]] = []

    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
    ) -> None:
        """Join as ``rank`` (the rank vLLM's single worker would hold: tensor parallel size 1)."""
        self.use_ray = use_ray
        if use_ray:
            import ray.util.collective as collective
            from ray.util.collective.types import Backend

            collective.init_collective_group(
                world_size, rank, backend=Backend(backend), group_name=group_name
            )
            self.group = group_name
        else:
            self.group = self.stateless_group(master_address, master_port, rank, world_size)

    def stateless_group(self, master_address: str, master_port: int, rank: int, world_size: int) -> Any:
        """The group the actor's side builds too (vLLM's PyNccl over a stateless store: CUDA)."""
        from openrlhf.utils.distributed_util import stateless_init_process_group

        return stateless_init_process_group(
            master_address, master_port, rank, world_size, torch.cuda.current_device()
        )

    def receive(self, name: str, dtype: torch.dtype, shape: Any, last: bool) -> None:
        """One parameter of the actor's broadcast (it sends from rank 0 after calling us)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        weight = torch.empty(shape, dtype=dtype, device=device)
        if self.use_ray:
            import ray.util.collective as collective

            collective.broadcast(weight, 0, group_name=self.group)
        else:
            self.group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        self._add(name, weight, last)

    def receive_ipc(self, name: str, dtype: torch.dtype, shape: Any, handles: dict, last: bool) -> None:
        """One parameter shared by CUDA IPC (colocated actor, NCCL backend)."""
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        rebuild, args = handles[get_physical_gpu_id()]
        args = list(args)
        args[6] = torch.cuda.current_device()  # the sender's device index, as this process numbers it
        weight = rebuild(*args).clone()  # the sender frees its buffer once this call returns
        torch.cuda.synchronize()
        self._add(name, weight, last)

    def _add(self, name: str, weight: torch.Tensor, last: bool) -> None:
        # The whole stream is loaded at once (PolicyCopy refuses a partial one), so until its last
        # tensor the copy holds the previous weights: stale, should the stream stop half-way.
        if not self.pending:
            self.executor.mark_stale("OpenRLHF's weight broadcast started and has not finished")
        self.pending.append((name, weight))
        if last:  # OpenRLHF 0.11.2 marks the last parameter with empty_cache=True
            stream, self.pending = self.pending, []
            self.executor.load_weights(stream)


class RolloutParts(_Rollout):  # type: ignore[misc, valid-type]
    """The unwrapped rollout actor class (Ray uses :data:`GRPOPartsRolloutActor`)."""

    receiver_class: type[WeightReceiver] = WeightReceiver

    # Ray awaits an async constructor (OpenRLHF's is one too)
    async def __init__(self, *args: Any, agent_func_path: str | None = None, **kwargs: Any) -> None:  # type: ignore[misc]
        executor = _load_agent_executor(agent_func_path) if agent_func_path else None
        self.receiver: WeightReceiver | None = None
        if not isinstance(executor, GRPOPartsAgentExecutor):
            # OpenRLHF's engine as shipped, given the executor loaded above (the agent file runs once)
            init = _Rollout.__init__
            if executor is not None:
                init = with_globals(init, _load_agent_executor=lambda _path: executor)
            await init(self, *args, agent_func_path=agent_func_path, **kwargs)
            return
        tp = kwargs.get("tensor_parallel_size", 1)
        if tp != 1:
            raise GRPOPartsError(
                f"--vllm.tensor_parallel_size {tp}: a GRPOPartsAgentExecutor samples in one process, "
                "which takes one rank of OpenRLHF's weight sync; use --vllm.tensor_parallel_size 1"
            )
        self._configure_device_env(
            backend=kwargs.get("distributed_executor_backend"),
            bundle_indices=kwargs.get("bundle_indices"),
            num_gpus=kwargs.pop("num_gpus", 1),
        )
        self.executor, self.kwargs, self.llm = executor, kwargs, None
        self._mm_pad_token_ids = kwargs.get("mm_pad_token_ids")
        self.receiver = self.receiver_class(executor)

    # -- weight sync: the vLLM worker's part, here (OpenRLHF's engine otherwise)

    async def init_process_group(self, *args: Any, **kwargs: Any) -> Any:
        """(master_address, master_port, rank_offset, world_size, group_name, backend, use_ray)"""
        if self.receiver is None:
            return await super().init_process_group(*args, **kwargs)
        self.receiver.init_process_group(*args, **kwargs)

    async def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> Any:
        if self.receiver is None:
            return await super().update_weight(name, dtype, shape, empty_cache)
        self.receiver.receive(name, dtype, shape, last=empty_cache)

    async def update_weight_cuda_ipc(
        self, name: str, dtype: Any, shape: Any, ipc_handles: Any, empty_cache: bool = False
    ) -> Any:
        if self.receiver is None:
            return await super().update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)
        self.receiver.receive_ipc(name, dtype, shape, ipc_handles, last=empty_cache)

    def grpo_parts_receives_weights(self) -> bool:
        return self.receiver is not None

    def grpo_parts_mark_stale(self, why: str) -> None:
        if self.receiver is not None:
            self.receiver.executor.mark_stale(why)

    def grpo_parts_weight_state(self) -> dict[str, Any]:
        """The executor's copy: syncs so far, why it is stale (None: fresh), counters."""
        if self.receiver is None:
            return {}
        copy = self.receiver.executor.policy_copy
        return {**copy.state(), **copy.counters()}

    # -- vLLM engine calls OpenRLHF makes: without vLLM there is nothing to do for most

    async def reset_prefix_cache(self) -> None:
        if self.receiver is None:
            await super().reset_prefix_cache()

    async def pause_generation(self) -> None:
        # the async trainer pauses around its broadcast: hold rollouts (waits for running ones)
        if self.receiver is None:
            return await super().pause_generation()
        self.receiver.executor.gate.hold()

    async def resume_generation(self) -> None:
        if self.receiver is None:
            return await super().resume_generation()
        self.receiver.executor.gate.release()

    async def sleep(self, level: int = 1) -> None:
        # sleep frees vLLM's weights and KV cache; the sampler's copy stays where it is
        if self.receiver is None:
            await super().sleep(level)

    async def wake_up(self, tags: Any = None) -> None:
        if self.receiver is None:
            await super().wake_up(tags)

    async def generate(
        self, prompt_token_ids: Any, sampling_params: Any, multi_modal_data: Any = None
    ) -> Any:
        if self.receiver is None:
            return await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        raise GRPOPartsError(
            "this rollout actor has no vLLM engine: its GRPOPartsAgentExecutor samples with its own sampler"
        )

    def get_num_unfinished_requests(self) -> int:
        # OpenRLHF balances prompts over engines with it; all prompts are dispatched at once anyway
        return super().get_num_unfinished_requests() if self.receiver is None else 0


GRPOPartsRolloutActor = ray.remote(RolloutParts)


def engines_receiving_weights(engines: list[Any] | None) -> list[Any]:
    """The engines whose grpo_parts executor takes OpenRLHF's broadcast (not vLLM engines)."""
    ours = [e for e in engines or [] if hasattr(e, "grpo_parts_receives_weights")]
    flags = ray.get([e.grpo_parts_receives_weights.remote() for e in ours])
    return [e for e, receives in zip(ours, flags) if receives]
