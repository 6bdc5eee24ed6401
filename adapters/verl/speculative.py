"""Speculative decoding in verl's vLLM rollout: the config to pass, and draft-weight sync. verl 0.9.1
forwards ``engine_kwargs.vllm.speculative_config`` to vLLM but never updates an independent draft after
launch, so :func:`sync_draft_weights` pushes a learned draft's weights to every vLLM worker through
``collective_rpc``; the servers keep the draft-length table they started with. GPU path:
scripts/gpu/verl_gpu_smoke.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from grpo_parts.errors import GRPOPartsError
from grpo_parts.sampler.vllm import VLLMSpeculative
from grpo_parts.sampler.vllm.online_draft import cost_model_table

from .options import hydra_value

OVERRIDE_PREFIX = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"
#: verl 0.9.1's ``actor_rollout_ref.rollout.max_num_seqs`` default
DEFAULT_MAX_NUM_SEQS = 1024


def hydra_overrides(
    spec: VLLMSpeculative, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, policy: torch.nn.Module | None = None
) -> list[str]:
    """``+key=value`` overrides of ``python -m verl.trainer.main_ppo`` that put ``spec`` into verl's
    ``rollout.engine_kwargs.vllm.speculative_config``; ``max_num_seqs``: verl's ``rollout.max_num_seqs`` (the
    table's range). With ``k_schedule="cost_model"`` the draft length per batch size is timed here on
    ``policy`` (and the draft LM, on the policy's device: run it where the rollout runs)."""
    cfg = spec.to_vllm(max_num_seqs)
    if spec.k_schedule == "cost_model":
        if policy is None:
            raise GRPOPartsError(
                "policy: k_schedule='cost_model' times the policy's forward for the draft-length table; "
                "expected the torch policy, got None"
            )
        model_len = int(getattr(policy.config, "max_position_embeddings", 2048))
        cfg["num_speculative_tokens_per_batch_size"] = cost_model_table(
            policy, None, spec, max_num_seqs, model_len, spec.accept_prior
        )[0]
    return [f"+{OVERRIDE_PREFIX}.{k}={hydra_value(v)}" for k, v in cfg.items()]


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
