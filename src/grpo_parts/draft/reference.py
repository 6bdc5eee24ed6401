"""Reference draft: a frozen small causal LM.

Deliberately simple: every ``propose`` re-encodes the full context (no KV cache), so it is
obviously correct; optimized drafts keep caches. It must share the policy's tokenizer (vocab).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..decoding import SamplingParams, sampling_probs
from ..errors import GRPOPartsError
from ..wrappers import inner_model
from .protocol import DraftContext, DraftProposal, DraftTrainingBatch, TreeBudget
from .tree import Frontier, topk_tree


class FrozenLMDraft:
    name: ClassVar[str] = "frozen_lm"
    learnable: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module):
        if getattr(model, "config", None) is None:
            raise GRPOPartsError(
                f"model: expected a transformers causal LM with .config, got {type(model).__name__}"
            )
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        reasons = []
        head: Any = inner_model(policy).get_output_embeddings()  # (a wrapped policy: its inner model)
        pv = getattr(head, "out_features", None) or head.weight.shape[0]  # (a sharded weight: out_features)
        dv = self.model.get_output_embeddings().weight.shape[0]  # type: ignore[operator, union-attr]
        if pv != dv:
            reasons.append(f"vocab size: draft has {dv} logits, policy has {pv}; they must share a tokenizer")
        return reasons

    def bind_policy(self, policy: torch.nn.Module) -> None:
        return None  # an independent model: nothing shared with the policy

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        return None

    @torch.no_grad()  # not inference_mode: rollout tensors feed autograd later
    def propose(
        self,
        context: DraftContext,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        tokens = context.tokens
        width = tokens.shape[1]
        mask = (
            torch.arange(width, device=tokens.device)[None, :] >= (width - context.lengths)[:, None]
        ).long()
        out_tok, out_prob = [], []
        for _ in range(num_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(
                input_ids=tokens, attention_mask=mask, position_ids=pos, logits_to_keep=1
            ).logits[:, -1]
            probs = sampling_probs(logits, params)
            if params.greedy:
                tok = probs.argmax(-1)
            else:
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            out_tok.append(tok)
            out_prob.append(probs)
            tokens = torch.cat([tokens, tok[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return DraftProposal(torch.stack(out_tok, 1), torch.stack(out_prob, 1))

    @torch.no_grad()
    def propose_tree(
        self,
        context: DraftContext,
        budget: TreeBudget,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        """Top-K expansion; every frontier node's context (prompt + path) is re-encoded in full."""
        tokens = context.tokens
        a, width = tokens.shape
        mask = (
            torch.arange(width, device=tokens.device)[None, :] >= (width - context.lengths)[:, None]
        ).long()

        def logits_of(ids: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            return self.model(input_ids=ids, attention_mask=m, position_ids=pos, logits_to_keep=1).logits[
                :, -1
            ]

        def expand(fr: Frontier) -> torch.Tensor:
            f = fr.tokens.shape[1]
            ids = torch.cat([tokens[:, None].expand(-1, f, -1), fr.paths], 2).reshape(a * f, -1)
            m = torch.cat([mask[:, None].expand(-1, f, -1), torch.ones_like(fr.paths)], 2).reshape(a * f, -1)
            return logits_of(ids, m).view(a, f, -1)

        return topk_tree(logits_of(tokens, mask), expand, budget, params)

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        return None

    def update(self, batch: DraftTrainingBatch) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # frozen: nothing changes, nothing to checkpoint

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
