"""Sampler in OpenRLHF: an ``AgentExecutor`` (``--train.agent_func_path``) that rolls out with a
grpo_parts :class:`~grpo_parts.sampler.protocol.Sampler` instead of the vLLM engine. OpenRLHF calls
``execute`` once per completion, ``n_samples_per_prompt`` times concurrently; the executor serves the
concurrent calls with **one** ``Sampler.generate`` so group-aware samplers see whole groups. Its policy
copy is fed by OpenRLHF's weight broadcast (:mod:`.rollout`); a rollout from stale weights is refused
unless ``allow_frozen=True``. docs/adapters/openrlhf.md, "Sampler" (with the agent file)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from openrlhf.utils.agent import AgentExecutorBase

from grpo_parts.counters import framework_keys
from grpo_parts.doors.policy_copy import PolicyCopy
from grpo_parts.doors.serving import RequestBatcher, sample_requests
from grpo_parts.errors import GRPOPartsError
from grpo_parts.sampler.protocol import SamplingParams
from grpo_parts.wrappers import transformers_model

#: ``extra_logs`` key marking a response as sampled by grpo_parts (OpenRLHF copies it into
#: ``Experience.info``; :class:`~.samples.GRPOPartsSamplesGenerator` counts and removes it).
SAMPLER_MARK = "grpo_parts_sampler"
#: one request's answer: completion ids, their log-probs, truncated, the rollout's stats
_Result = tuple[list[int], list[float], bool, dict[str, float]]
#: named in refusals
DOOR = "OpenRLHF GRPOPartsAgentExecutor"
#: why a fresh executor's copy is stale: only the launcher's rollout actor delivers the broadcast
NEVER_SYNCED = (
    "it has not received the actor's weights (OpenRLHF broadcasts them to this executor only when "
    "the run is started with python -m grpo_parts_adapters.openrlhf.launch, synchronous trainer)"
)


def sampling_params_from_vllm(
    sp: Any,
    prompt_len: int,
    max_length: int,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int,
    group_size: int,
) -> SamplingParams:
    """vLLM ``SamplingParams`` (as OpenRLHF builds them) -> grpo_parts ``SamplingParams``."""
    max_tokens = getattr(sp, "max_tokens", None) or max(1, max_length - prompt_len)
    stop = tuple(getattr(sp, "stop_token_ids", None) or ())
    top_k = int(getattr(sp, "top_k", -1) or -1)
    return SamplingParams(
        group_size=group_size,
        max_new_tokens=int(max_tokens),
        temperature=float(getattr(sp, "temperature", 1.0)),
        top_p=float(getattr(sp, "top_p", 1.0)),
        top_k=max(top_k, 0),
        eos_token_ids=tuple(dict.fromkeys(eos_token_ids + stop)),
        pad_token_id=pad_token_id,
    )


def sampler_policy(sampler: Any) -> torch.nn.Module:
    """The transformers model a grpo_parts sampler decodes with: where the actor's weights go."""
    module = getattr(sampler, "policy", None)
    module = getattr(sampler, "model", None) if module is None else module
    if not isinstance(module, torch.nn.Module):
        raise GRPOPartsError(
            f"{DOOR}: sampler {type(sampler).__name__} has no policy module (.policy or .model) to load the "
            "actor's weights into; expected a grpo_parts sampler over a transformers model"
        )
    return transformers_model(module)


class RolloutGate:
    """Rollouts share the weights; a weight load (or a pause, OpenRLHF's async trainer brackets its
    broadcast with one) waits for running rollouts and holds new ones, so no rollout ever samples
    from a half-loaded copy. Holds are counted (a load inside a pause nests)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._holds = 0

    @contextmanager
    def rollout(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._holds == 0)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            self._holds += 1
            self._cond.wait_for(lambda: self._running == 0)

    def release(self) -> None:
        with self._cond:
            self._holds = max(0, self._holds - 1)
            self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()


class GRPOPartsAgentExecutor(AgentExecutorBase):
    """``sampler``: a grpo_parts Sampler or a zero-argument factory (called on first use in the rollout
    actor). ``reward_fn(queries, prompts, labels)``: OpenRLHF's reward-function signature; None = no
    reward. ``seed``: reproducible sampling per executor. ``allow_frozen``: serve rollouts from weights
    that do not follow the trained policy (counted as ``parts/sampler/frozen_rollouts``)."""

    def __init__(
        self,
        sampler: Any,
        reward_fn: Callable[..., Any] | None = None,
        seed: int | None = None,
        *,
        allow_frozen: bool = False,
    ):
        self._sampler = sampler
        self.reward_fn = reward_fn
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.allow_frozen = allow_frozen
        self.gate = RolloutGate()
        # the factory may be reached from a load and a rollout at once; concurrent rollouts count
        self._lock = threading.Lock()
        self._copy: PolicyCopy | None = None
        self.batcher: RequestBatcher[tuple[SamplingParams, int], _Result] = RequestBatcher(self._generate)
        self.generate_calls = 0

    @property
    def sampler(self) -> Any:
        with self._lock:
            if callable(self._sampler) and not hasattr(self._sampler, "generate"):
                self._sampler = self._sampler()
        return self._sampler

    @property
    def policy_copy(self) -> PolicyCopy:
        """The sampler's model as a :class:`PolicyCopy` (built with the sampler, on first use)."""
        sampler = self.sampler
        with self._lock:
            if self._copy is None:
                self._copy = PolicyCopy(sampler_policy(sampler), door=DOOR, allow_frozen=self.allow_frozen)
                self._copy.mark_stale(NEVER_SYNCED)
        return self._copy

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the actor's whole ``(name, tensor)`` stream into the sampler's model (between
        rollouts); returns how many tensors were loaded. The copy is fresh afterwards."""
        copy = self.policy_copy
        with self.gate.held():
            return copy.load(weights)

    def mark_stale(self, why: str) -> None:
        """The actor is being updated: rollouts are refused until the next :meth:`load_weights`."""
        self.policy_copy.mark_stale(why)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Copy ``policy``'s parameters in (outside OpenRLHF's broadcast, e.g. in a test)."""
        self.load_weights(policy.named_parameters())

    async def execute(
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any = None,
        images: Any = None,
    ) -> dict[str, Any]:
        if images:
            raise NotImplementedError(
                "GRPOPartsAgentExecutor: image prompts are not rolled out through this door (it "
                "tokenizes text only; grpo_parts rolls image prompts out with the reference sampler in "
                "TRL and your own loop: docs/attention.md)"
            )
        encoded = hf_tokenizer(text=prompt, add_special_tokens=False, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        eos = hf_tokenizer.eos_token_id
        eos_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        pad = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else (eos_ids or (0,))[0]
        key = (sampling_params_from_vllm(sampling_params, len(ids), max_length, eos_ids, pad, 1), max_length)
        completion, logps, truncated, stats = await self.batcher.submit(key, ids)
        # the rollout's Rollout.stats (lean_forward_calls, ...): OpenRLHF copies extra_logs into
        # Experience.info, which it logs; the mark counts the rollout (parts/sampler/rollouts)
        logs = {**framework_keys("sampler", stats), SAMPLER_MARK: 1.0}
        out: dict[str, Any] = {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "observation_tokens": ids + completion,
            "action_ranges": [(len(ids), len(ids) + len(completion))],
            "rollout_log_probs": [0.0] * len(ids) + logps
            if getattr(sampling_params, "logprobs", None) is not None
            else None,
            "truncated": truncated,
            "reward": None,
            "scores": None,
            "extra_logs": dict(logs),
        }
        if self.reward_fn is not None:
            query = hf_tokenizer.decode(out["observation_tokens"], skip_special_tokens=False)
            info = await asyncio.to_thread(self.reward_fn, [query], [prompt], [label])
            rewards = info.get("rewards")
            scores = info.get("scores", rewards)
            out.update(
                reward=float(torch.as_tensor(rewards).flatten()[0]),
                scores=float(torch.as_tensor(scores).flatten()[0]),
                extra_logs={**(info.get("extra_logs") or {}), **logs},
            )
        return out

    def _generate(self, key: tuple[SamplingParams, int], prompts: list[list[int]]) -> list[_Result]:
        """One ``Sampler.generate`` for the queued prompts of one key
        (:func:`grpo_parts.doors.serving.sample_requests`), between weight loads."""
        copy = self.policy_copy
        with self.gate.rollout():  # no weight load while this rollout samples
            with self._lock:
                copy.check_fresh()  # refuses (one line) unless fresh or allow_frozen (then counted)
                stats = copy.counters()
            self.generate_calls += 1
            answers, rollout = sample_requests(self.sampler, prompts, key[0], self.generator)
        stats.update(rollout.stats)
        return [(*answer, dict(stats)) for answer in answers]
