"""Speculative decoding in OpenRLHF's vLLM engines: :func:`create_vllm_engines_with` gives every engine
vLLM's own ``speculative_config`` and, with ``draft_sync="shared"``, the worker extension
:class:`GRPOPartsWorkerWrap`, which loads the parameters an EAGLE/MTP draft shares with the policy from
OpenRLHF's broadcast into the drafter (online-trained draft weights are not pushed); with an agent file,
:mod:`.rollout`'s actor in place of ``RolloutRayActor``. docs/adapters/openrlhf.md, "Sampler"."""

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
    """``create_vllm_engines`` (same signature) with :func:`engine_kwargs` on every engine and, given
    ``agent_func_path``, ``rollout_class`` in place of ``RolloutRayActor``; OpenRLHF's function runs as
    shipped on a private copy of its module namespace (:func:`._scoped.with_globals`)."""
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
