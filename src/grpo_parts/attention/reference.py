"""Reference attention backend: every completion re-encodes its prompt (the standard GRPO path).

Rows ``[left-padded prompt | right-padded completion]`` run through the model's own attention with
positions counting real tokens, as during sampling, so the log-probs equal the sampler's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..core import token_logprobs
from ..errors import GRPOPartsError
from ..wrappers import calls_through, model_name
from .protocol import LogprobBatch, LogprobOutput
from .vision import image_batch_reasons, row_positions


def completion_output(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float, entropy: bool
) -> LogprobOutput:
    """Log-probs (and entropies) of completions ``ids: [N, T]`` (``mask``: real tokens) from
    ``logits: [N, S, V]``, the logits predicting their first ``S`` tokens (every backend's last
    step); zero on padding."""
    cm = mask.bool()
    s, t = logits.shape[1], cm.shape[1]

    def full(x: torch.Tensor) -> torch.Tensor:  # [N, S] -> [N, T]: zero past the longest completion
        return (x if s == t else nn.functional.pad(x, (0, t - s))).masked_fill(~cm, 0.0)

    logps = full(token_logprobs(logits, ids[:, :s], temperature))
    if not entropy:
        return LogprobOutput(logps, None)
    x = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(x / temperature, dim=-1)
    return LogprobOutput(logps, full(-(logp.exp() * logp).sum(-1)))


class RepeatedPrefixAttention:
    name: ClassVar[str] = "reference"

    def not_supported_reasons(self, model: nn.Module, batch: LogprobBatch | None = None) -> list[str]:
        cfg = getattr(calls_through(model), "config", None)
        if cfg is None:
            return [f"model: expected a transformers causal LM with .config, got {model_name(model)}"]
        if getattr(cfg, "is_encoder_decoder", False):
            return [f"model: encoder-decoder models ({cfg.model_type}) are not supported"]
        return image_batch_reasons(calls_through(model), batch)

    def register_kernel(self) -> str | None:
        return None  # uses the model's own attention implementation

    def completion_logprobs(
        self, model: nn.Module, batch: LogprobBatch, temperature: float = 1.0, compute_entropy: bool = False
    ) -> LogprobOutput:
        model = calls_through(model)
        reasons = self.not_supported_reasons(model, batch)
        if reasons:
            raise GRPOPartsError("; ".join(reasons))
        p, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask.long(), batch.completion_mask.long()], dim=1)
        # each row brings its own prompt's images (repeated per completion: what this reference is for)
        images = {} if batch.vision is None else batch.vision.gather(batch.group_index.tolist())
        pos, _ = row_positions(model, ids, mask, images)
        # Only the logits that predict completion tokens are needed: positions P-1 .. P+T-2 (sliced
        # here too: a forward may ignore logits_to_keep, as transformers 4.x Qwen2-VL's does)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=t + 1, **images
        ).logits[:, -(t + 1) : -1]
        assert logits.shape[1] == t, (logits.shape, p, t)
        return completion_output(
            logits, batch.completion_ids, batch.completion_mask, temperature, compute_entropy
        )
