"""The KV-cached form of :class:`~grpo_parts.draft.reference.FrozenLMDraft`: the same proposals
(tested), cached as the EAGLE head is (:mod:`.kv_state`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..compat import cache_kwarg
from ..decoding import SamplingParams, tree_attention_mask
from .drawing import draw_chain, draw_tree, new_columns
from .kv_state import DraftKVState
from .protocol import DraftContext, DraftProposal, TreeBudget
from .reference import FrozenLMDraft
from .tree import Frontier


class CachedLMDraft(FrozenLMDraft):
    """``CachedLMDraft(small_model)``: a frozen small LM sharing the policy's tokenizer, KV-cached;
    ``sampled_trees``: the kind of tree (:func:`~.drawing.draw_tree`)."""

    name: ClassVar[str] = "small_lm"

    def __init__(self, model: torch.nn.Module, sampled_trees: bool = True):
        super().__init__(model)
        self.sampled_trees = sampled_trees
        self._kv: DraftKVState | None = None
        self._seen = torch.empty(0, dtype=torch.long)  # real tokens in the cache, per row

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        self._start(torch.arange(prompts.shape[0], device=prompts.device))

    def _start(self, rows: torch.Tensor) -> DraftKVState:
        self._kv = DraftKVState(rows)
        self._seen = torch.zeros_like(rows)
        return self._kv

    def _forward(
        self, kv: DraftKVState, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=kv.append(valid), position_ids=pos, use_cache=True,
            logits_to_keep=1, **{cache_kwarg(self.model): kv.cache},
        )  # fmt: skip
        return out.logits[:, -1]

    @torch.no_grad()
    def propose(
        self, context: DraftContext, num_tokens: int, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        kv, logits = self._feed_new(context)

        def step(i: int, d: torch.Tensor) -> torch.Tensor:
            return self._forward(kv, d[:, None], torch.ones_like(d[:, None]), (context.lengths + i)[:, None])

        prop = draw_chain(logits, step, num_tokens, params, generator)
        kv.spec = num_tokens - 1
        return prop

    def _feed_new(self, context: DraftContext) -> tuple[DraftKVState, torch.Tensor]:
        """Feed each row's tokens the cache has not seen (right-aligned; shorter rows leave holes);
        returns the cache state and the next-token logits ``[A, V]``."""
        kv = self._kv or self._start(context.rows)  # propose without reset: a fresh cache
        sel = kv.begin_call(context.rows)  # crop last call's drafted entries, drop finished rows
        if sel is not None:
            self._seen = self._seen[sel]
        lengths = context.lengths
        num_new = (lengths - self._seen).clamp(min=1)
        m = int(num_new.max())
        valid, pos = new_columns(num_new, lengths, m)
        logits = self._forward(kv, context.tokens[:, -m:], valid, pos)
        self._seen = lengths.clone()
        return kv, logits

    @torch.no_grad()
    def propose_tree(
        self, context: DraftContext, budget: TreeBudget, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """One cached forward per level under a tree mask (the tree's kind: :func:`~.drawing.draw_tree`)."""
        kv, root = self._feed_new(context)
        past = kv.mask.shape[1]
        dtype = next(self.model.parameters()).dtype

        def expand(fr: Frontier) -> torch.Tensor:
            kv.append(torch.ones_like(fr.tokens))
            out = self.model(
                input_ids=fr.tokens, attention_mask=tree_attention_mask(kv.mask[:, :past], fr.anc, dtype), use_cache=True,
                position_ids=(context.lengths[:, None] + fr.depth - 1).expand_as(fr.tokens),
                **{cache_kwarg(self.model): kv.cache},
            )  # fmt: skip
            return out.logits

        prop = draw_tree(root, expand, budget, params, generator, self.sampled_trees)
        kv.spec = kv.mask.shape[1] - past
        return prop

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        self._kv = None  # free the rollout's cache
