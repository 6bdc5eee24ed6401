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

from typing import ClassVar

import torch

from ..compat import cache_kwarg
from ..decoding import SamplingParams, sampling_probs
from .kv_state import DraftKVState
from .protocol import DraftContext, DraftProposal
from .reference import FrozenLMDraft


class CachedLMDraft(FrozenLMDraft):
    """``CachedLMDraft(small_model)``: a frozen small LM sharing the policy's tokenizer, KV-cached."""

    name: ClassVar[str] = "small_lm"

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
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
        self,
        context: DraftContext,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        kv = self._kv or self._start(context.rows)  # propose without reset: a fresh cache
        sel = kv.begin_call(context.rows)  # crop last call's drafted entries, drop finished rows
        if sel is not None:
            self._seen = self._seen[sel]
        # feed each row's tokens the cache has not seen (right-aligned; shorter rows leave holes)
        lengths = context.lengths
        num_new = (lengths - self._seen).clamp(min=1)
        m = int(num_new.max())
        j = torch.arange(m, device=lengths.device)
        valid = (j[None, :] >= (m - num_new)[:, None]).long()
        pos = (lengths[:, None] - m + j[None, :]).clamp(min=0)
        logits = self._forward(kv, context.tokens[:, -m:], valid, pos)
        self._seen = lengths.clone()
        toks, probs = [], []
        for i in range(num_tokens):
            q = sampling_probs(logits, params)
            d = q.argmax(-1) if params.greedy else torch.multinomial(q, 1, generator=generator).squeeze(-1)
            toks.append(d)
            probs.append(q)
            if i == num_tokens - 1:
                break
            logits = self._forward(kv, d[:, None], torch.ones_like(d[:, None]), (lengths + i)[:, None])
        kv.spec = num_tokens - 1
        return DraftProposal(torch.stack(toks, 1), torch.stack(probs, 1))

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        self._kv = None  # free the rollout's cache
