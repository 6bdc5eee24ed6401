"""N-gram / suffix draft: no weights, no sync, nothing to train.

A row's continuation is looked up in the token sequences most likely to repeat it: its own prompt
and its own text so far, its **sibling completions** in the group (GRPO samples G completions of
the same prompt, which share long stretches), and **earlier rollouts of the same prompt** (kept
across rollouts, keyed by the prompt's tokens). The longest suffix of the row (``max_ngram`` down
to ``min_ngram`` tokens) found in that pool proposes the tokens that followed its most recent
occurrence; the lookup is chained until ``k`` tokens are drafted.

Proposals are deterministic (``probs=None``): the verifier treats them as point masses, which keeps
verification exact at any temperature (accept ``d`` with probability ``p(d)``, else resample from
``p`` without ``d``). Rows with no match propose their last token repeated (cheap filler that the
verifier simply rejects; the cost model sees the low acceptance and drafts less).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..decoding import SamplingParams
from ..errors import GRPOPartsError
from .protocol import DraftContext, DraftProposal, DraftTrainingBatch

Key = tuple[int, ...]


class _Pool:
    """The sequences of one prompt group and an index ``ngram -> (sequence, end)`` of the most
    recent occurrence of every n-gram that has a continuation."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.seqs: list[list[int]] = []
        self.index: dict[Key, tuple[int, int]] = {}

    def add(self, tokens: list[int]) -> int:
        sid = len(self.seqs)
        self.seqs.append([])
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        seq = self.seqs[sid]
        for tok in tokens:
            e = len(seq)  # the n-grams ending at e now have a continuation: ``tok``
            for n in range(self.lo, min(self.hi, e) + 1):
                self.index[tuple(seq[e - n : e])] = (sid, e)
            seq.append(tok)

    def continuation(self, tail: list[int], k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            ctx = tail + out
            for n in range(min(self.hi, len(ctx)), self.lo - 1, -1):
                hit = self.index.get(tuple(ctx[len(ctx) - n :]))
                if hit is not None:
                    sid, e = hit
                    out += self.seqs[sid][e : e + k - len(out)]
                    break
            else:
                break
        return out


class NGramDraft:
    """``NGramDraft(max_ngram=4, min_ngram=1, history_per_prompt=16, max_prompts=4096)``."""

    name: ClassVar[str] = "ngram"
    learnable: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False

    def __init__(
        self, max_ngram: int = 4, min_ngram: int = 1, history_per_prompt: int = 16, max_prompts: int = 4096
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise GRPOPartsError(
                f"min_ngram/max_ngram: expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        if history_per_prompt < 0 or max_prompts < 1:
            raise GRPOPartsError(
                f"history_per_prompt/max_prompts: expected >= 0 and >= 1, got {history_per_prompt}, {max_prompts}"
            )
        self.lo, self.hi = min_ngram, max_ngram
        self.history_per_prompt, self.max_prompts = history_per_prompt, max_prompts
        #: prompt tokens -> earlier completions of that prompt (oldest first), LRU over prompts
        self.history: OrderedDict[Key, list[list[int]]] = OrderedDict()
        self._pools: dict[int, _Pool] = {}
        self._keys: dict[int, Key] = {}
        self._row_sid: dict[int, int] = {}
        self._row_group: dict[int, int] = {}

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        return []  # works with any tokenizer: it only copies token ids the policy already produced

    def bind_policy(self, policy: torch.nn.Module) -> None:
        return None

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        self._pools, self._keys, self._row_sid, self._row_group = {}, {}, {}, {}
        rows = prompts.tolist()
        masks = prompt_mask.long().tolist()
        for r, (ids, m, g) in enumerate(zip(rows, masks, group_index.tolist())):
            prompt = [t for t, keep in zip(ids, m) if keep]
            if g not in self._pools:
                pool = _Pool(self.lo, self.hi)
                key = tuple(prompt)
                pool.add(prompt)
                for old in self.history.get(key, []):
                    pool.add(prompt + old)
                self._pools[g], self._keys[g] = pool, key
            self._row_sid[r] = self._pools[g].add(prompt)
            self._row_group[r] = g

    def propose(
        self,
        context: DraftContext,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        k = num_tokens
        lengths = context.lengths.tolist()
        tokens = context.tokens
        out = torch.empty(tokens.shape[0], k, dtype=torch.long)
        # only the tail each row gained since the last call is converted to Python
        known = [len(self._pools[self._row_group[r]].seqs[self._row_sid[r]]) for r in context.rows.tolist()]
        grow = max(1, max(n - s for n, s in zip(lengths, known)))
        tail_rows = tokens[:, -max(grow, self.hi) :].tolist()
        for a, r in enumerate(context.rows.tolist()):
            pool, sid = self._pools[self._row_group[r]], self._row_sid[r]
            new = lengths[a] - known[a]
            if new > 0:
                pool.extend(sid, tail_rows[a][len(tail_rows[a]) - new :])
            seq = pool.seqs[sid]
            cont = pool.continuation(seq[-self.hi :], k)
            fill = cont[-1] if cont else seq[-1]
            out[a] = torch.tensor(cont + [fill] * (k - len(cont)), dtype=torch.long)
        return DraftProposal(out.to(tokens.device), None)

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        if self.history_per_prompt == 0:
            return
        for ids, m, g in zip(completions.tolist(), completion_mask.long().tolist(), group_index.tolist()):
            key = self._keys.get(g)
            if key is None:
                continue
            hist = self.history.setdefault(key, [])
            hist.append([t for t, keep in zip(ids, m) if keep])
            del hist[: -self.history_per_prompt]
            self.history.move_to_end(key)
        while len(self.history) > self.max_prompts:
            self.history.popitem(last=False)

    def update(self, batch: DraftTrainingBatch) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"history": [(list(k), v) for k, v in self.history.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "history" not in state:
            raise GRPOPartsError(f"state: expected a 'history' entry, got keys {sorted(state)}")
        self.history = OrderedDict((tuple(k), [list(c) for c in v]) for k, v in state["history"])
