"""Agent loop ``grpo_parts_agent``: a verl ``AgentLoopBase`` that samples with grpo_parts. ``sampler:
server`` (default) uses verl's vLLM/SGLang servers (speculative decoding: :mod:`.speculative`); ``sampler:
<name>`` runs a grpo_parts ``Sampler`` in the agent-loop worker (:class:`SamplerServer`) on the model
``model_factory`` builds. verl's weight sync never reaches that copy, so it refuses every rollout unless
``allow_frozen: true``; to train with grpo_parts' sampler use the rollout backend (:mod:`.rollout`).
docs/adapters/verl.md, "Agent loop ``grpo_parts_agent``"."""

from __future__ import annotations

import asyncio
import importlib
from collections import Counter
from typing import Any
from uuid import uuid4

import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.workers.rollout.replica import TokenOutput

from grpo_parts import build as parts_build
from grpo_parts.doors.policy_copy import PolicyCopy
from grpo_parts.doors.serving import RequestBatcher, sample_requests
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.sampler.protocol import Sampler, SamplingParams

NAME = "grpo_parts_agent"


def sampling_params_from_verl(
    params: dict[str, Any], max_new_tokens: int, eos_token_ids: tuple[int, ...], pad_token_id: int
) -> SamplingParams:
    """verl/vLLM sampling dict (``top_k=-1`` = off, ``temperature=0`` = greedy) -> SamplingParams."""
    top_k = int(params.get("top_k", -1) or 0)
    return SamplingParams(
        group_size=1,
        max_new_tokens=int(params.get("max_tokens", max_new_tokens)),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
    )


class SamplerServer:
    """verl's ``generate(request_id, *, prompt_ids, sampling_params, ...) -> TokenOutput`` by a grpo_parts
    ``Sampler``: the requests waiting when it is free go as one batch of up to ``max_batch`` rows, identical
    prompts as one group (:class:`grpo_parts.doors.serving.RequestBatcher`), so it sees the real groups."""

    def __init__(
        self,
        sampler: Sampler,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int,
        max_new_tokens: int,
        max_batch: int = 256,
        gather_s: float = 0.005,
    ):
        self.sampler = sampler
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        #: every rollout's ``Rollout.stats`` summed (``lean_forward_calls``, ...) and ``rollouts``
        self.totals: Counter[str] = Counter()
        self.batch_sizes: list[int] = []
        self.batcher: RequestBatcher[SamplingParams, TokenOutput] = RequestBatcher(
            self.generate_batch, gather_s, max_batch
        )

    def params(self, sampling_params: dict[str, Any]) -> SamplingParams:
        return sampling_params_from_verl(
            sampling_params, self.max_new_tokens, self.eos_token_ids, self.pad_token_id
        )

    def generate_batch(
        self, params: SamplingParams, prompts: list[list[int]], seed: int | None = None
    ) -> list[TokenOutput]:
        """One sampler call for several prompts, one completion each
        (:func:`grpo_parts.doors.serving.sample_requests`)."""
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        answers, rollout = sample_requests(self.sampler, prompts, params, gen)
        self.totals.update(rollout.stats)
        self.totals["rollouts"] += 1
        self.batch_sizes.append(len(prompts))
        stats = dict(rollout.stats)
        return [
            TokenOutput(
                token_ids=i,
                log_probs=lp,
                stop_reason="completed",
                extra_fields={"grpo_parts_stats": dict(stats)},
            )
            for i, lp, _ in answers
        ]

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **extra: Any
    ) -> TokenOutput:
        media = [k for k in ("image_data", "video_data", "audio_data") if extra.get(k)]
        if media:  # sampling the token ids alone would roll out without the images: never silently
            why = (
                f"verl passed {', '.join(media)} with the prompt: this server rolls out token ids only "
                "and would sample without them; use verl's vLLM/SGLang rollout for a vision-language "
                "policy (the engine hook serves its log-probs: docs/adapters/verl.md)"
            )
            raise NotSupportedError("grpo_parts verl rollout", [why])
        return await self.batcher.submit(self.params(sampling_params), prompt_ids)


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise GRPOPartsError(f"model_factory: expected 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


_LOCAL_SERVERS: dict[tuple[str, str, str], SamplerServer] = {}  # one model per worker process
_COPIES: dict[tuple[str, str, str], PolicyCopy] = {}  # their policy copies (never synced by verl)


def plain_dict(kwargs: Any) -> dict[str, Any]:
    """A verl config node (a hydra ``DictConfig``), a mapping or None as a plain dict with ``str`` keys."""
    if kwargs is None:
        return {}
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)
    return {str(k): v for k, v in dict(raw).items()}  # type: ignore[arg-type]


def build_sampler(
    name: str, model: torch.nn.Module, draft: str | None = None, draft_factory: str | None = None,
    sampler_kwargs: dict[str, Any] | None = None,
) -> Sampler:  # fmt: skip
    """A grpo_parts sampler by name (:func:`grpo_parts.build.build_sampler`, with ``sampler_kwargs``); one
    that takes a draft gets ``draft_factory(policy)`` (``"module:function"``) or else the draft ``draft`` by
    name (:func:`grpo_parts.build.build_draft`: on the policy when it takes a model, e.g. ``frozen_lm``)."""
    if draft_factory is not None:
        made = _load(draft_factory)(model)
    else:
        made = parts_build.build_draft(draft, model, where="draft")
    kw = dict(sampler_kwargs or {})
    return parts_build.build_sampler(name, model, kwargs=kw, draft=made, where="sampler_kwargs")


class GrpoPartsAgentLoop(AgentLoopBase):
    """Single-turn agent loop over verl's server or an in-process grpo_parts sampler."""

    def __init__(
        self,
        *args: Any,
        sampler: str = "server",
        draft: str | None = None,
        draft_factory: str | None = None,
        model_factory: str | None = None,
        sampler_kwargs: dict[str, Any] | None = None,
        allow_frozen: bool = False,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.allow_frozen = bool(allow_frozen)
        self.response_length = self.rollout_config.response_length
        self.sampler_name, self.draft_name, self.draft_factory = sampler, draft, draft_factory
        self.model_factory = model_factory
        self.sampler_kwargs = plain_dict(sampler_kwargs)

    def _local_server(self) -> SamplerServer:
        path = str(self.config.actor_rollout_ref.model.path)
        key = (
            self.model_factory or path, self.sampler_name,
            f"{self.draft_name}|{self.draft_factory}|{sorted(self.sampler_kwargs.items())}",
        )  # fmt: skip
        if key not in _LOCAL_SERVERS:
            if self.model_factory:
                model = _load(self.model_factory)()
            else:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(path).eval()
            tok: Any = self.tokenizer
            eos = tok.eos_token_id
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            sampler = build_sampler(
                self.sampler_name, model, self.draft_name, self.draft_factory, self.sampler_kwargs
            )
            _LOCAL_SERVERS[key] = SamplerServer(sampler, eos_ids, pad, self.response_length)
            _COPIES[key] = PolicyCopy(model, door=f"verl agent loop {NAME!r} (sampler: {self.sampler_name})")
        # the copy is never synced by verl: every rollout is refused unless frozen on purpose
        copy = _COPIES[key]
        copy.allow_frozen = self.allow_frozen
        copy.mark_stale(
            "verl syncs the actor's weights to its rollout servers, never to this agent loop's own copy "
            "(train with actor_rollout_ref.rollout.name=grpo_parts)"
        )
        copy.check_fresh()
        _LOCAL_SERVERS[key].totals["frozen_rollouts"] = copy.frozen_rollouts
        return _LOCAL_SERVERS[key]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        server = self.server_manager if self.sampler_name == "server" else self._local_server()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out: TokenOutput = await server.generate(
            request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=dict(sampling_params)
        )
        elapsed = loop.time() - t0
        n = min(len(out.token_ids), self.response_length)
        logprobs = list(out.log_probs[:n]) if out.log_probs else None
        extra = {**out.extra_fields, "turn_scores": [], "tool_rewards": []}
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=list(out.token_ids[:n]),
            response_mask=[1] * n,
            response_logprobs=logprobs,
            num_turns=2,
            metrics=AgentLoopMetrics(
                generate_sequences=elapsed,
                num_preempted=-1 if out.num_preempted is None else out.num_preempted,
            ),
            extra_fields=extra,
        )


def register_agent_loop() -> None:
    """Register ``grpo_parts_agent`` with verl's agent-loop registry (idempotent)."""
    register(NAME)(GrpoPartsAgentLoop)
