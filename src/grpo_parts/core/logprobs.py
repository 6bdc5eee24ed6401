"""The one definition of a per-token log-prob in grpo_parts."""

from __future__ import annotations

import torch

from ..errors import GRPOPartsError, check_tensor


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``: ``[..., V] x [...] -> [...]``; as in TRL
    and verl, temperature applied, top-p / top-k not (samplers return it, attention backends compute it)."""
    if temperature <= 0:
        raise GRPOPartsError(f"temperature: expected > 0 for log-probs, got {temperature}")
    check_tensor("tokens", tokens, shape=list(logits.shape[:-1]), dtype="int", allow_empty=True)
    lg = logits if temperature == 1.0 else logits / temperature
    return (
        torch.log_softmax(lg.float() if lg.dtype in (torch.float16, torch.bfloat16) else lg, dim=-1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )
