"""The sampler's own copy of the policy, kept equal to the trained one by the framework's weight sync.

verl and OpenRLHF train the policy in one process (an FSDP / DeepSpeed worker) and roll out in
another (a rollout server, a vLLM engine actor). When grpo_parts' sampler does the rollout there, it
runs on its own transformers copy of the policy, and that copy must receive the actor's weights after
every update through the framework's own weight-sync path, or every step samples from stale weights
while the actor trains (an off-policy update that nothing reports).

:class:`PolicyCopy` decides it for every door, framework-free (no verl/OpenRLHF import);
``allow_frozen=True`` opts in to a frozen sampler (debugging, evaluating a fixed checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..counters import FROZEN_ROLLOUTS, WEIGHT_SYNCS
from ..errors import GRPOPartsError

__all__ = ["PolicyCopy", "StaleWeightsError", "WEIGHT_SYNCS", "FROZEN_ROLLOUTS", "canonical_name"]


#: path segments wrappers insert into a transformers parameter name (DDP/DeepSpeed add a leading
#: ``module``, FSDP1, torch.compile and activation checkpointing theirs anywhere)
_WRAPPER_SEGMENTS = {"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"}


class StaleWeightsError(GRPOPartsError):
    """A rollout was asked of a sampler whose weights do not follow the trained policy."""


def canonical_name(name: str) -> str:
    """``name`` without the prefixes FSDP, DDP, DeepSpeed, torch.compile and activation
    checkpointing insert (anywhere in the dotted path)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


class PolicyCopy:
    """``model``: the sampler's module. ``door``: named in refusals (``"verl rollout 'grpo_parts'"``).
    ``allow_frozen``: serve rollouts without any sync (explicit opt-in, counted)."""

    #: the counters :meth:`counters` reports
    COUNTERS = (WEIGHT_SYNCS, FROZEN_ROLLOUTS)

    def __init__(self, model: torch.nn.Module, *, door: str, allow_frozen: bool = False) -> None:
        self.model, self.door, self.allow_frozen = model, door, allow_frozen
        self.syncs = self.frozen_rollouts = 0
        self._stale_since: str | None = "it was loaded from disk and has not received the actor's weights"
        self._targets = self._named_targets(model)
        self._loading: set[str] = set()

    @staticmethod
    def _named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            out[canonical_name(n)] = p
        for n, b in model.named_buffers(remove_duplicate=False):
            out.setdefault(canonical_name(n), b)
        return out

    def mark_stale(self, why: str) -> None:
        """The framework updated (or is about to update) the actor: rollouts wait for a sync."""
        self._stale_since = why

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the actor's whole ``(name, tensor)`` stream in (:meth:`begin`, :meth:`load_part`,
        :meth:`finish`); returns how many tensors were loaded."""
        self.begin()
        self.load_part(weights)
        return self.finish()

    def begin(self) -> None:
        """A sync starts: rollouts wait until :meth:`finish` (a half-loaded copy mixes two policies)."""
        self._loading = set()
        self._stale_since = "a weight sync is in progress"

    @torch.no_grad()
    def load_part(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of the sync. Refuses names the copy does not have and shapes that differ (a
        different model)."""
        for raw, tensor in weights:
            name = canonical_name(raw)
            target = self._targets.get(name)
            if target is None:
                raise GRPOPartsError(
                    f"weights: the actor sent {raw!r}, which the {self.door} sampler's policy copy does not "
                    "have; expected the same architecture as the actor's model"
                )
            t = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if tuple(t.shape) != tuple(target.shape):
                raise GRPOPartsError(
                    f"weights: {raw!r} has shape {tuple(t.shape)}, the {self.door} sampler's copy "
                    f"{tuple(target.shape)}; expected the same model"
                )
            target.copy_(t.to(device=target.device, dtype=target.dtype))
            self._loading.add(name)

    def finish(self) -> int:
        """The sync ends: refuses one that left a parameter untouched; counts it."""
        loaded = self._loading
        missing = self._missing(loaded)
        if missing:
            self._stale_since = (
                f"the last sync left {len(missing)} parameters untouched (e.g. {missing[0]!r})"
            )
            raise GRPOPartsError(
                f"weights: the actor's sync left {len(missing)} of the {self.door} sampler's parameters "
                f"untouched (e.g. {missing[0]!r}); expected every parameter of the policy"
            )
        self.syncs += 1
        self._stale_since = None
        return len(loaded)

    def last_sync(self) -> list[tuple[str, torch.Tensor]]:
        """The copy's tensors under the names the last sync sent (for checksums against the sender)."""
        return [(n, self._targets[n]) for n in sorted(self._loading)]

    def _missing(self, loaded: set[str]) -> list[str]:
        params = {canonical_name(n): p for n, p in self.model.named_parameters(remove_duplicate=False)}
        loaded_ptrs = {params[n].data_ptr() for n in loaded if n in params}
        # tied weights (lm_head = embed_tokens): loading one name loads both
        return [n for n, p in params.items() if n not in loaded and p.data_ptr() not in loaded_ptrs]

    def stale_reason(self) -> str | None:
        """Why a rollout now would not sample from the trained policy (None: it would)."""
        return (
            None if self._stale_since is None else f"the sampler's policy copy is stale: {self._stale_since}"
        )

    def check_fresh(self) -> None:
        """Refuse (one line) a rollout from weights that do not follow the trained policy, unless
        ``allow_frozen``; a frozen rollout is counted."""
        why = self.stale_reason()
        if why is None:
            return
        if self.allow_frozen:
            self.frozen_rollouts += 1
            return
        raise StaleWeightsError(
            f"{self.door}: refusing a training rollout: {why} (each step must sample from the weights being "
            "trained; set allow_frozen: true only to sample from a fixed policy on purpose)"
        )

    def counters(self) -> dict[str, float]:
        return {WEIGHT_SYNCS: float(self.syncs), FROZEN_ROLLOUTS: float(self.frozen_rollouts)}

    def state(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "stale": self.stale_reason(), "allow_frozen": self.allow_frozen}
