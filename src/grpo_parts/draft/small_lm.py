"""A frozen small causal LM draft with a KV cache (the optimized form of :class:`FrozenLMDraft`).

:class:`~grpo_parts.draft.reference.FrozenLMDraft` re-encodes each row's whole context for every
draft token, which is obviously correct but grows with context length and batch. This draft keeps
one KV cache per rollout, as the EAGLE head does:

* each ``propose`` first feeds the tokens verified since the row's previous call (rows accept
  different counts, so the new tokens are right-aligned and shorter rows leave masked *holes*, with
  explicit positions so a hole never shifts a position), then drafts ``k`` tokens autoregressively;
* its ``k - 1`` speculative entries are cropped at the next call, where the verified tokens
  replace them; rows that finished leave the cache; holes beyond half the cache are compacted.

Its proposals are the same distributions as :class:`FrozenLMDraft`'s (tested), only cheaper.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..sampler.logits import sampling_probs
from ..sampler.protocol import SamplingParams
from ..sampler.verify import compact_cache
from .protocol import DraftContext, DraftProposal
from .reference import FrozenLMDraft


class CachedLMDraft(FrozenLMDraft):
    """``CachedLMDraft(small_model)``: a frozen small LM sharing the policy's tokenizer, KV-cached."""

    name: ClassVar[str] = "small_lm"

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._cache: Any = None
        self._mask = self._rows = self._seen = torch.empty(0, dtype=torch.long)
        self._spec = 0

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        from transformers import DynamicCache

        n, device = prompts.shape[0], prompts.device
        self._cache = DynamicCache()
        self._mask = torch.zeros(n, 0, dtype=torch.long, device=device)
        self._rows = torch.arange(n, device=device)
        self._seen = torch.zeros(n, dtype=torch.long, device=device)  # real tokens in the cache, per row
        self._spec = 0

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self._mask = torch.cat([self._mask, valid], 1)
        out = self.model(
            input_ids=ids, attention_mask=self._mask, position_ids=pos, past_key_values=self._cache,
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        return out.logits[:, -1]

    @torch.no_grad()
    def propose(
        self,
        context: DraftContext,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        if self._cache is None:  # propose without reset: start a cache for these rows
            self.reset(context.tokens, torch.ones_like(context.tokens), context.group_index)
            self._rows = context.rows.clone()
        if self._spec:  # last call's drafted entries: the verified tokens replace them
            self._cache.crop(self._mask.shape[1] - self._spec)
            self._mask = self._mask[:, : -self._spec]
        if not torch.equal(context.rows, self._rows):  # rows finished since the last call
            pos_of = {int(r): i for i, r in enumerate(self._rows.tolist())}
            sel = torch.tensor([pos_of[int(r)] for r in context.rows.tolist()], device=self._mask.device)
            self._cache.batch_select_indices(sel)
            self._mask, self._seen, self._rows = self._mask[sel], self._seen[sel], context.rows.clone()
        if self._mask.shape[1] > 64 and float(self._mask.sum(-1).max()) < 0.5 * self._mask.shape[1]:
            new = compact_cache(self._cache, self._mask)
            self._mask = self._mask if new is None else new
        # feed each row's tokens the cache has not seen (right-aligned; shorter rows leave holes)
        lengths = context.lengths
        num_new = (lengths - self._seen).clamp(min=1)
        m = int(num_new.max())
        j = torch.arange(m, device=lengths.device)
        valid = (j[None, :] >= (m - num_new)[:, None]).long()
        pos = (lengths[:, None] - m + j[None, :]).clamp(min=0)
        logits = self._forward(context.tokens[:, -m:], valid, pos)
        self._seen = lengths.clone()
        toks, probs = [], []
        for i in range(num_tokens):
            q = sampling_probs(logits, params)
            d = q.argmax(-1) if params.greedy else torch.multinomial(q, 1, generator=generator).squeeze(-1)
            toks.append(d)
            probs.append(q)
            if i == num_tokens - 1:
                break
            logits = self._forward(d[:, None], torch.ones_like(d[:, None]), (lengths + i)[:, None])
        self._spec = num_tokens - 1
        return DraftProposal(torch.stack(toks, 1), torch.stack(probs, 1))

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        self._cache = None  # free the rollout's cache
