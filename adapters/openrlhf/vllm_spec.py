"""Speculative decoding in OpenRLHF's vLLM engines, with draft weight sync.

OpenRLHF's ``create_vllm_engines`` builds each ``RolloutRayActor`` from a fixed set of keyword
arguments, all of which reach ``vllm.AsyncEngineArgs``. :func:`create_vllm_engines_with` wraps it so
every engine also gets ``speculative_config`` (vLLM's own format: ``{"method": "ngram", ...}``,
``{"method": "eagle", "model": ..., "num_speculative_tokens": k}``, ...) and, when the draft shares
weights with the policy, the worker extension :class:`GRPOPartsWorkerWrap`.

Draft weight sync: OpenRLHF broadcasts every policy parameter to the engines after each update
(``update_weight`` on the worker extension), into the *target* model only. With
``draft_sync="shared"`` :class:`GRPOPartsWorkerWrap` also loads the parameters an EAGLE/MTP draft
shares with the policy (token embedding, LM head) into the drafter, so the draft never reads stale
embeddings. n-gram drafts need no sync. Pushing separately trained draft weights (online draft
learning) is not wired here. Everything in this module except the kwargs plumbing needs a GPU and
vLLM; the CPU tests check the plumbing only (docs/adapters/openrlhf.md, scripts/gpu/openrlhf_gpu_smoke.sh).

With an agent file (``--train.agent_func_path``) :func:`create_vllm_engines_with` also builds the
launcher's rollout actor class (:mod:`.rollout`) in place of ``RolloutRayActor``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from ._scoped import with_globals
from .config import OpenRLHFPartsConfig

#: parameters an EAGLE/MTP head reuses from the policy (HF names, as OpenRLHF broadcasts them)
SHARED_DRAFT_PARAMS: tuple[str, ...] = ("model.embed_tokens.weight", "lm_head.weight")
WORKER_EXTENSION = f"{__name__}.GRPOPartsWorkerWrap"


def engine_kwargs(parts: OpenRLHFPartsConfig) -> dict[str, Any]:
    """Extra ``RolloutRayActor`` / ``AsyncEngineArgs`` keyword arguments for ``parts``."""
    out: dict[str, Any] = {}
    if parts.speculative_config:
        out["speculative_config"] = dict(parts.speculative_config)
        if parts.draft_sync == "shared":
            out["worker_extension_cls"] = WORKER_EXTENSION
    return out


class _ActorClassWithKwargs:
    """Stands in for the ``RolloutRayActor`` Ray class inside one ``create_vllm_engines`` call:
    ``.options(...).remote(**kw)`` forwards to the real class with ``extra`` merged into ``kw``."""

    def __init__(self, actor_cls: Any, extra: dict[str, Any]):
        self.actor_cls, self.extra = actor_cls, extra

    def options(self, **options: Any) -> Any:
        bound = self.actor_cls.options(**options)
        extra = self.extra

        class _Bound:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                return bound.remote(*args, **{**kwargs, **extra})

        return _Bound()


def create_vllm_engines_with(parts: OpenRLHFPartsConfig, rollout_class: Any = None) -> Callable[..., Any]:
    """``create_vllm_engines`` (same signature) that adds :func:`engine_kwargs` to every engine and,
    when an agent file is given (``agent_func_path``), builds ``rollout_class`` (default
    :data:`.rollout.GRPOPartsRolloutActor`: OpenRLHF's engine, or for a grpo_parts executor a
    rollout actor that takes OpenRLHF's weight broadcast). OpenRLHF's function runs as shipped,
    reading ``RolloutRayActor`` from a private copy of its module namespace
    (:func:`._scoped.with_globals`); the module itself is not changed."""
    from openrlhf.trainer.ray import vllm_engine

    extra = engine_kwargs(parts)

    def create(*args: Any, **kwargs: Any) -> Any:
        actor_cls = vllm_engine.RolloutRayActor
        if kwargs.get("agent_func_path"):
            from .rollout import GRPOPartsRolloutActor

            actor_cls = rollout_class or GRPOPartsRolloutActor
        if extra:
            actor_cls = _ActorClassWithKwargs(actor_cls, extra)
        if actor_cls is vllm_engine.RolloutRayActor:
            return vllm_engine.create_vllm_engines(*args, **kwargs)
        return with_globals(vllm_engine.create_vllm_engines, RolloutRayActor=actor_cls)(*args, **kwargs)

    return create


class GRPOPartsWorkerWrap(WorkerWrap):
    """OpenRLHF's vLLM worker extension plus draft sync of the shared parameters."""

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
        super().update_weight(name, dtype, shape, empty_cache)
        self._sync_draft(name)

    def update_weight_cuda_ipc(
        self, name: str, dtype: Any, shape: Any, ipc_handles: Any = None, empty_cache: bool = False
    ) -> None:
        super().update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)
        self._sync_draft(name)

    def _sync_draft(self, name: str) -> bool:
        """Copy the policy's freshly loaded ``name`` into the drafter when the draft has its own copy.
        Returns whether anything was loaded."""
        if name not in SHARED_DRAFT_PARAMS:
            return False
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        draft_model = getattr(drafter, "model", None)
        if draft_model is None:
            return False
        target = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        mine = dict(draft_model.named_parameters())
        if name not in target or name not in mine or mine[name] is target[name]:
            return False  # absent, or already the same tensor (vLLM shares it): nothing to do
        draft_model.load_weights(weights=[(name, target[name].data)])
        return True
