"""grpo_parts' sampler as a verl rollout backend: ``actor_rollout_ref.rollout.name=grpo_parts``. verl 0.9.1
picks a rollout by name from two registries, one per side of the weight sync: :class:`GRPOPartsReplica`
starts one :class:`GRPOPartsServer` per node, answering verl's ``generate`` with a grpo_parts ``Sampler``
on a :class:`~grpo_parts.doors.policy_copy.PolicyCopy` that refuses to sample while stale unless
``allow_frozen``; :class:`GRPOPartsRollout` streams the actor's weights to it from verl's naive checkpoint
engine. docs/adapters/verl.md, "Sampler / DraftModel: the rollout backend"."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from grpo_parts.counters import framework_key
from grpo_parts.doors.policy_copy import PolicyCopy, canonical_name
from grpo_parts.errors import GRPOPartsError
from grpo_parts.parts_config import DOOR_DEFAULTS
from grpo_parts.sampler.stats import DRAFT_UPDATES, PLAIN_STEPS, SAMPLED_TREE_STEPS, STEP_CALL_COUNTS

from .agent_loop import SamplerServer, build_sampler, plain_dict
from .options import ROLLOUT_NAME, hydra_value

logger = logging.getLogger(__name__)

NAME = ROLLOUT_NAME
#: ``actor_rollout_ref.rollout.engine_kwargs`` key holding :class:`RolloutOptions`
OPTIONS_KEY = "grpo_parts"


class RolloutOptions(BaseModel):
    """``actor_rollout_ref.rollout.engine_kwargs.grpo_parts.*``: ``sampler`` and ``draft`` by name,
    ``sampler_kwargs``, ``allow_frozen`` (debugging only), ``follow_actor=False`` (with ``allow_frozen``:
    a control run that drops the syncs), ``sync_log`` (a JSONL line per sync with checksums of both
    sides), ``max_batch`` (requests per sampler call)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sampler: str = DOOR_DEFAULTS["verl"]["sampler"]
    draft: str | None = DOOR_DEFAULTS["verl"]["draft"]
    sampler_kwargs: dict[str, Any] = Field(default_factory=dict)
    allow_frozen: bool = False
    follow_actor: bool = True
    sync_log: str | None = None
    max_batch: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _frozen_on_purpose(self) -> RolloutOptions:
        if not self.follow_actor and not self.allow_frozen:
            raise ValueError(
                "follow_actor=False samples from a policy the actor never updates; expected allow_frozen=True with it"
            )
        return self

    @classmethod
    def from_rollout_config(cls, config: Any) -> RolloutOptions:
        raw = plain_dict((getattr(config, "engine_kwargs", None) or {}).get(OPTIONS_KEY))
        try:
            return cls(**raw)
        except Exception as e:  # pydantic names the field and the value
            raise GRPOPartsError(f"actor_rollout_ref.rollout.engine_kwargs.{OPTIONS_KEY}: {e}") from None


#: ``extra_fields`` key of each sample: its server's cumulative totals (:func:`sampler_metrics`)
TOTALS_FIELD = "grpo_parts_totals"
TOTALS_REPLICA = "replica"
#: what a sample carries to verl's metrics: the sampler's call counts and the weight-sync counters
_COUNTED = (PLAIN_STEPS, SAMPLED_TREE_STEPS, DRAFT_UPDATES, "rollouts", "ignored_syncs")
COUNTERS = frozenset((*STEP_CALL_COUNTS, *_COUNTED, *PolicyCopy.COUNTERS))


def sampler_metrics(extra_fields: Iterable[Any]) -> dict[str, float]:
    """verl metrics from a batch's samples: every replica's cumulative counters (the largest value
    any of its samples carries: ``weight_syncs``, ``verify_steps``, ``lean_forward_calls``, ...), summed
    over replicas, as ``parts/sampler/<counter>``."""
    latest: dict[float, dict[str, float]] = {}
    for extra in extra_fields:
        totals = (extra or {}).get(TOTALS_FIELD) if isinstance(extra, dict) else None
        if not totals:
            continue
        mine = latest.setdefault(float(totals.get(TOTALS_REPLICA, 0.0)), {})
        for k, v in totals.items():
            if k != TOTALS_REPLICA:
                mine[k] = max(mine.get(k, 0.0), float(v))
    out: dict[str, float] = {}
    for totals in latest.values():
        for k, v in totals.items():
            out[framework_key("sampler", k)] = out.get(framework_key("sampler", k), 0.0) + v
    return out


def server_name(replica_rank: int, node_rank: int) -> str:
    return f"{NAME}_server_{replica_rank}_{node_rank}"


def _load_policy(model_config: Any, load_format: str) -> torch.nn.Module:
    """The server's policy copy: verl's ``load_format: dummy`` (its default) builds it from the config
    only -- the actor's first sync fills it -- anything else loads the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = getattr(model_config, "local_path", None) or model_config.path
    if load_format == "dummy":
        cfg = AutoConfig.from_pretrained(
            path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
        return AutoModelForCausalLM.from_config(cfg).eval()
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _token_ids(model_config: Any) -> tuple[tuple[int, ...], int]:
    from transformers import AutoTokenizer

    tok = getattr(model_config, "tokenizer", None)
    if tok is None:
        tok = AutoTokenizer.from_pretrained(getattr(model_config, "local_path", None) or model_config.path)
    eos = tok.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return eos_ids, tok.pad_token_id if tok.pad_token_id is not None else 0


class GRPOPartsServer:
    """One node's rollout server: verl's ``generate`` served by a grpo_parts sampler on a policy copy
    that follows the actor (the methods verl's replica and checkpoint manager call are here)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, node_rank: int = 0) -> None:
        self.options = RolloutOptions.from_rollout_config(config)
        # a frozen copy is the checkpoint itself; a following one is filled by the actor's first sync
        fmt = str(getattr(config, "load_format", "dummy")) if self.options.follow_actor else "auto"
        model = _load_policy(model_config, fmt)
        door = f"verl rollout {NAME!r} (replica {replica_rank})"
        self.copy = PolicyCopy(model, door=door, allow_frozen=self.options.allow_frozen)
        sampler = build_sampler(
            self.options.sampler, model, self.options.draft, sampler_kwargs=self.options.sampler_kwargs
        )
        eos, pad = _token_ids(model_config)
        self.server = SamplerServer(sampler, eos, pad, int(config.response_length), self.options.max_batch)
        self.global_steps: int | None = None
        self.ignored_syncs = 0
        self.replica_rank = replica_rank

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **media: Any
    ) -> TokenOutput:
        self.copy.check_fresh()
        out = await self.server.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **media
        )  # image_data / video_data / audio_data: refused there, never dropped
        extra = dict(out.extra_fields)
        stats = {**extra.get("grpo_parts_stats", {}), **self.copy.counters()}
        totals = {TOTALS_REPLICA: float(self.replica_rank), **self.counters()}
        extra.update(grpo_parts_stats=stats, grpo_parts_totals=totals, global_steps=self.global_steps)
        return out.model_copy(update={"extra_fields": extra})

    # ---- weight sync (called by GRPOPartsRollout in the actor worker)
    async def update_weights(
        self,
        bucket: list[tuple[str, torch.Tensor]],
        first: bool,
        last: bool,
        sent_checksum: float | None = None,
    ) -> int:
        if not self.options.follow_actor:
            self.ignored_syncs += int(last)
            return 0
        if first:
            self.copy.begin()
        self.copy.load_part(bucket)
        if not last:
            return len(bucket)
        n = self.copy.finish()
        if self.options.sync_log:
            self._log_sync(sent_checksum)
        return n

    def _log_sync(self, sent: float | None) -> None:
        row = {
            "global_steps": self.global_steps,
            "syncs": self.copy.syncs,
            "sent_checksum": sent,
            "copy_checksum": checksum(self.copy.last_sync()),
            "totals": self.totals(),
        }
        with open(str(self.options.sync_log), "a") as f:
            f.write(json.dumps(row) + "\n")

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ---- lifecycle verl's replica and checkpoint manager drive
    async def sleep(self) -> None:
        # verl sleeps the rollout after sampling, before the actor's update: the copy is stale
        # until the sync that follows the update
        self.copy.mark_stale("the actor was updated after the last sync (verl put the rollout to sleep)")

    async def _nothing_to_do(self, *args: Any, **kwargs: Any) -> None:
        """The lifecycle calls with no work here: weights stay resident (CPU / small models; freshness
        is the sync's business), the sampler keeps no cache between rollouts, and under the sync
        trainer no request is in flight at a weight sync."""

    wake_up = clear_kv_cache = abort_all_requests = release_kv_cache = _nothing_to_do
    resume_kv_cache = resume_generation = start_profile = stop_profile = _nothing_to_do

    def totals(self) -> dict[str, float]:
        """Every rollout's stats summed, plus the weight-sync counters."""
        out = {**{k: float(v) for k, v in self.server.totals.items()}, **self.copy.counters()}
        return {**out, "ignored_syncs": float(self.ignored_syncs)}

    def counters(self) -> dict[str, float]:
        """:meth:`totals` restricted to counts (rates and seconds do not add up across rollouts)."""
        return {k: v for k, v in self.totals().items() if k in COUNTERS}


class GRPOPartsReplica(RolloutReplica):
    """verl's rollout replica for ``rollout.name=grpo_parts``: one :class:`GRPOPartsServer` actor per
    node, on the node of the replica's workers."""

    async def launch_servers(self) -> None:
        node_ids: list[Any] = await asyncio.gather(
            *[
                w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                for w in self.workers
            ]
        )
        actor_cls = ray.remote(GRPOPartsServer)
        for node_rank in range(self.nnodes):
            node_id = node_ids[node_rank * self.gpus_per_replica_node] if node_ids else None
            strategy = (
                ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
                if node_id is not None
                else "DEFAULT"
            )
            server: Any = actor_cls.options(  # type: ignore[attr-defined]
                name=server_name(self.replica_rank, node_rank) + self.name_suffix,
                num_cpus=0,  # shares the node's CPUs with the workers, as vLLM shares their GPUs
                scheduling_strategy=strategy,
                max_concurrency=self.max_concurrency,
            ).remote(self.config, self.model_config, self.replica_rank, node_rank)
            self.servers.append(server)
        self._server_handle = self.servers[0]
        self._server_address = server_name(self.replica_rank, 0) + self.name_suffix


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """A float64 fingerprint of a set of weights, independent of their order and of name prefixes:
    equal weights give equal values (used to show the copy holds what the actor sent)."""
    total = 0.0
    for name, t in named:
        w = float(sum(map(ord, canonical_name(name)))) / 1000.0
        total += float(t.detach().double().sum()) * w + float(t.detach().double().square().sum())
    return total


def _buckets(
    weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        cpu = full.detach().to("cpu", copy=True)
        bucket.append((name, cpu))
        size += cpu.numel() * cpu.element_size()
        if size >= max_bytes:
            yield bucket
            bucket, size = [], 0
    yield bucket


class GRPOPartsRollout(BaseRollout):
    """The worker side of the sync: verl hands it the actor's weights after every update; rank 0 of
    each replica's rollout world streams them to its server (every rank drains the stream: FSDP
    gathers each full tensor collectively)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        c = self.config
        world = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        local_world = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", str(world)))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.node_rank = self.rollout_rank // max(1, local_world)
        self._server: Any = None
        self.syncs = 0
        self.options = RolloutOptions.from_rollout_config(self.config)

    def _handle(self) -> Any:
        if self.rollout_rank != 0:
            return None
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank, self.node_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        h = self._handle()
        if h is not None:
            await h.wake_up.remote(tags=tags)

    async def release(self) -> None:
        h = self._handle()
        if h is not None:
            await h.sleep.remote()

    @torch.no_grad()
    async def update_weights(  # type: ignore[override]
        self, weights: Iterable[Any], wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        global_steps, peft_config = kwargs.get("global_steps"), kwargs.get("peft_config")
        if wire_format != "named_tensors":
            raise GRPOPartsError(
                f"rollout.checkpoint_engine: the {NAME!r} rollout takes full tensors (wire_format "
                f"'named_tensors'), got {wire_format!r}; use checkpoint_engine.backend=naive"
            )
        if peft_config is not None:
            raise GRPOPartsError(
                f"actor_rollout_ref.model.lora: the {NAME!r} rollout needs merged weights, got LoRA adapters "
                "alone; set actor_rollout_ref.model.lora.merge=True"
            )
        h = self._handle()
        mb = int(getattr(self.config.checkpoint_engine, "update_weights_bucket_megabytes", 512) or 512)
        first = True
        pending: list[tuple[str, torch.Tensor]] | None = None
        sent = 0.0
        for bucket in _buckets(weights, mb << 20):
            sent += checksum(bucket) if self.options.sync_log else 0.0
            if pending is not None and h is not None:
                await h.update_weights.remote(pending, first, False)
                first = False
            pending = bucket
        if h is not None:
            await h.update_weights.remote(pending or [], first, True, sent if self.options.sync_log else None)
            if global_steps is not None:
                await h.set_global_steps.remote(global_steps)
        self.syncs += 1


def hydra_overrides(**options: Any) -> list[str]:
    """The Hydra overrides of ``python -m verl.trainer.main_ppo`` that make grpo_parts' sampler the
    rollout, with :class:`RolloutOptions` keys (validated here, before verl starts)."""
    RolloutOptions(**options)
    node = f"+actor_rollout_ref.rollout.engine_kwargs.{OPTIONS_KEY}"
    out = [f"actor_rollout_ref.rollout.name={NAME}"]
    for key, value in options.items():
        if isinstance(value, dict):
            out += [f"{node}.{key}.{k}={hydra_value(v)}" for k, v in value.items()]
        else:
            out.append(f"{node}.{key}={hydra_value(value)}")
    return out
