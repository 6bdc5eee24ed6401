"""Speculative decoding in verl's vLLM rollout: the config to pass, and draft-weight sync.

verl 0.9.1 forwards ``actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config`` to vLLM and
syncs *MTP* drafters with the actor, but an independent draft (EAGLE head, small LM) is never
updated after launch. A grpo_parts online-learned draft changes every step, so after each
``DraftModel.update`` its weights must be pushed to every vLLM worker of every rollout replica:
:func:`sync_draft_weights` does that through verl's ``collective_rpc`` on the rollout server actors
(the callable runs inside each vLLM worker process and calls the drafter's ``load_weights``).

What runs on CPU here: building the config / Hydra overrides and the sync call against stand-ins.
The GPU path (vLLM accepting the config, ``load_weights`` on a real drafter) is exercised only by
scripts/gpu/verl_gpu_smoke.py. vLLM sizes drafts statically (``num_speculative_tokens``); FastGRPO's
concurrency-aware sizing is available only with grpo_parts' own speculative sampler
(:mod:`.agent_loop` with ``sampler: speculative``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

OVERRIDE_PREFIX = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"


class VllmSpeculativeOptions(BaseModel):
    """vLLM ``speculative_config``. ``method``: ``eagle``/``eagle3`` (a draft head at ``model``),
    ``draft_model`` (a small LM at ``model``, same tokenizer), ``ngram`` (prompt lookup, no weights)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["eagle", "eagle3", "draft_model", "ngram"] = "ngram"
    model: str | None = None
    num_speculative_tokens: int = Field(3, ge=1, le=16)
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    draft_tensor_parallel_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> VllmSpeculativeOptions:
        if self.method != "ngram" and not self.model:
            raise ValueError(f"model: expected a draft path for method={self.method!r}, got None")
        if self.method == "ngram" and self.model:
            raise ValueError(f"model: n-gram drafting uses no weights, got model={self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: expected <= prompt_lookup_max={self.prompt_lookup_max}, got {self.prompt_lookup_min}"
            )
        return self

    def to_vllm(self) -> dict[str, Any]:
        """The dict vLLM's ``speculative_config`` takes."""
        cfg: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            cfg.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        else:
            cfg["model"] = self.model
            if self.draft_tensor_parallel_size is not None:
                cfg["draft_tensor_parallel_size"] = self.draft_tensor_parallel_size
        return cfg

    def hydra_overrides(self) -> list[str]:
        """``+key=value`` command-line overrides for ``python -m verl.trainer.main_ppo``."""
        return [f"+{OVERRIDE_PREFIX}.{k}={v}" for k, v in self.to_vllm().items()]


def draft_weight_loader(worker: Any, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Runs inside a vLLM worker (via ``collective_rpc``): load ``weights`` into the drafter.
    Returns how many tensors were handed over."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None or not hasattr(model, "load_weights"):
        raise RuntimeError(
            "vLLM worker has no drafter model with load_weights; launch the rollout with a speculative_config "
            "whose method uses a draft model (eagle, eagle3, draft_model)"
        )
    device = next(model.parameters()).device
    model.load_weights((name, t.to(device)) for name, t in weights)
    return len(weights)


def sync_draft_weights(
    server_handles: Iterable[Any],
    state_dict: Mapping[str, torch.Tensor],
    *,
    get: Any = None,
    timeout: float | None = None,
) -> int:
    """Push a draft's ``state_dict`` to every rollout replica (verl's vLLM server Ray actors, e.g.
    ``trainer._rollout_server_managers()`` handles). Call it after every ``DraftModel.update``, before
    the next rollout. ``get`` resolves remote futures (default ``ray.get``). Returns the replica count."""
    if get is None:
        import ray

        get = ray.get
    weights = [(k, v.detach().cpu()) for k, v in state_dict.items()]
    futures = [
        h.collective_rpc.remote(draft_weight_loader, timeout=timeout, args=(weights,), kwargs=None)
        for h in server_handles
    ]
    get(futures)
    return len(futures)
