"""Reference draft: a frozen small causal LM sharing the policy's tokenizer.

Every ``propose`` re-encodes the full context (no KV cache), so it is obviously correct.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..decoding import SamplingParams
from ..errors import GRPOPartsError
from ..wrappers import inner_model
from .drawing import draw_chain
from .protocol import DraftContext, DraftProposal, StatelessDraft, TreeBudget
from .tree import Frontier, topk_tree


class FrozenLMDraft(StatelessDraft):
    name: ClassVar[str] = "frozen_lm"

    def __init__(self, model: torch.nn.Module):
        if getattr(model, "config", None) is None:
            raise GRPOPartsError(
                f"model: expected a transformers causal LM with .config, got {type(model).__name__}"
            )
        self.model = model.eval().requires_grad_(False)

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        head: Any = inner_model(policy).get_output_embeddings()  # (a wrapped policy: its inner model)
        pv = getattr(head, "out_features", None) or head.weight.shape[0]  # (a sharded weight: out_features)
        dv = self.model.get_output_embeddings().weight.shape[0]  # type: ignore[operator, union-attr]
        if pv != dv:
            return [f"vocab size: draft has {dv} logits, policy has {pv}; they must share a tokenizer"]
        return []

    def _next_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next-token logits ``[R, V]`` after each row of ``ids`` (left-padded by ``mask``)."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        return out.logits[:, -1]

    @staticmethod
    def _mask(context: DraftContext) -> torch.Tensor:
        width = context.tokens.shape[1]
        col = torch.arange(width, device=context.tokens.device)
        return (col[None, :] >= (width - context.lengths)[:, None]).long()

    @torch.no_grad()  # not inference_mode: rollout tensors feed autograd later
    def propose(
        self, context: DraftContext, num_tokens: int, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        tokens, mask = context.tokens, self._mask(context)

        def step(i: int, tok: torch.Tensor) -> torch.Tensor:
            nonlocal tokens, mask
            tokens = torch.cat([tokens, tok[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            return self._next_logits(tokens, mask)

        return draw_chain(self._next_logits(tokens, mask), step, num_tokens, params, generator)

    @torch.no_grad()
    def propose_tree(
        self, context: DraftContext, budget: TreeBudget, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """Top-K expansion; every frontier node's context (prompt + path) is re-encoded in full."""
        tokens, mask = context.tokens, self._mask(context)
        a = tokens.shape[0]

        def expand(fr: Frontier) -> torch.Tensor:
            f = fr.tokens.shape[1]
            ids = torch.cat([tokens[:, None].expand(-1, f, -1), fr.paths], 2).reshape(a * f, -1)
            m = torch.cat([mask[:, None].expand(-1, f, -1), torch.ones_like(fr.paths)], 2).reshape(a * f, -1)
            return self._next_logits(ids, m).view(a, f, -1)

        return topk_tree(self._next_logits(tokens, mask), expand, budget, params)
