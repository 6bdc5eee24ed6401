"""N-gram / suffix draft: no weights, no sync, nothing to train.

A row's longest suffix (``max_ngram`` down to ``min_ngram`` tokens) is looked up in its prompt, its
own text, its sibling completions and earlier rollouts of the same prompt; the lookup chains until
``k`` tokens are drafted. Where occurrences disagree, the longest agreeing preceding text wins, then
the row's own text, then the most recent (docs/speculative.md, "N-gram draft in the tail").
Proposals are point masses (``probs=None``), so verification stays exact at any temperature; rows
with no match repeat their last token (the cost model sees the low acceptance and drafts less).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..decoding import SamplingParams
from ..errors import GRPOPartsError
from .protocol import DraftContext, DraftProposal, StatelessDraft, TreeBudget

Key = tuple[int, ...]
#: how far back ``_Pool._best`` compares an occurrence's text with the row's
AGREE = 32


class _Pool:
    """The sequences of one prompt group and an index ``ngram -> [(sequence, end), ...]`` of the
    most recent occurrences (oldest first, at most ``keep``) of every n-gram that has a continuation."""

    def __init__(self, lo: int, hi: int, keep: int = 16, base: _Pool | None = None):
        self.lo, self.hi, self.keep = lo, hi, keep
        #: a pool this one extends without changing it (a prompt's indexed history): its sequences
        #: come first, and an n-gram's occurrences are the base's followed by this pool's
        self.base = base
        self.seqs: list[list[int]] = [] if base is None else list(base.seqs)
        self.index: dict[Key, list[tuple[int, int]]] = {}
        #: n-gram -> its continuations ranked by share (count, then recency); dropped when it gains one
        self._ranked: dict[Key, list[tuple[int, float]]] = {}

    def add(self, tokens: list[int], known: int = 0) -> int:
        """A new sequence starting with ``tokens``; its first ``known`` tokens are not indexed (a
        copy of the prompt, which the pool already holds as sequence 0: the n-grams ending inside
        it continue as the prompt does)."""
        sid = len(self.seqs)
        self.seqs.append(list(tokens[:known]))
        self.extend(sid, tokens[known:])
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        seq, index, ranked = self.seqs[sid], self.index, self._ranked
        lo, hi, keep = self.lo, self.hi, self.keep
        for tok in tokens:
            e = len(seq)  # the n-grams ending at e now have a continuation: ``tok``
            for n in range(lo, min(hi, e) + 1):
                key = tuple(seq[e - n : e])
                occ = index.get(key)
                if occ is None:
                    index[key] = [(sid, e)]
                else:
                    occ.append((sid, e))
                    if len(occ) > keep:
                        del occ[0]
                if key in ranked:  # (a key new here may have been ranked on the base's occurrences)
                    del ranked[key]
            seq.append(tok)

    def occurrences(self, key: Key) -> list[tuple[int, int]] | None:
        """The most recent occurrences of ``key`` (oldest first, at most ``keep``), or None."""
        own = self.index.get(key)
        old = None if self.base is None else self.base.index.get(key)
        if old is None:
            return own
        return old if own is None else (old + own)[-self.keep :]

    def continuation(self, tail: list[int], k: int, own: int = -1) -> list[int]:
        """Chain the best occurrence (:meth:`_best`) of the longest matching suffix until ``k`` tokens
        (``max_ngram`` tokens often fail to place a row within a line that repeats with small changes)."""
        out: list[int] = []
        while len(out) < k:
            ctx = tail + out
            for n in range(min(self.hi, len(ctx)), self.lo - 1, -1):
                key = tuple(ctx[len(ctx) - n :])
                occ = self.occurrences(key)
                if occ:
                    sid, e = occ[-1] if len(self.ranked(key)) == 1 else self._best(occ, ctx, n, own)
                    out += self.seqs[sid][e : e + k - len(out)]
                    break
            else:
                break
        return out

    def _best(self, occ: list[tuple[int, int]], ctx: list[int], n: int, own: int) -> tuple[int, int]:
        """The occurrence whose text before the matched ``n`` tokens agrees longest with ``ctx``
        (up to ``AGREE`` tokens), then the one in sequence ``own``, then the most recent."""
        best, best_score = occ[-1], (-1, False, -1)
        seqs, top_ctx = self.seqs, min(AGREE, len(ctx))
        for rank, (sid, e) in enumerate(occ):
            seq, m, top = seqs[sid], n, min(top_ctx, e)
            while m < top and seq[e - m - 1] == ctx[-m - 1]:
                m += 1
            score = (m, sid == own, rank)
            if score > best_score:
                best, best_score = (sid, e), score
        return best

    def ranked(self, key: Key) -> list[tuple[int, float]]:
        """The distinct continuations of the n-gram ``key`` with their share of its occurrences,
        best first (count, then recency); cached until the n-gram gains an occurrence."""
        got = self._ranked.get(key)
        if got is None:
            counts: dict[int, float] = {}
            for rank, (sid, e) in enumerate(self.occurrences(key) or ()):  # oldest first: recent wins ties
                tok = self.seqs[sid][e]
                counts[tok] = counts.get(tok, 0.0) + 1.0 + 1e-3 * rank
            total = sum(counts.values())
            got = self._ranked[key] = [
                (t, c / total) for t, c in sorted(counts.items(), key=lambda kv: -kv[1])
            ]
        return got

    def branches(self, ctx: list[int], width: int) -> list[tuple[int, float]]:
        """Up to ``width`` distinct next tokens after ``ctx`` with their share of the occurrences of
        the longest matching suffix (count, then recency); shorter suffixes add tokens at half weight."""
        out: dict[int, float] = {}
        weight = 1.0
        for n in range(min(self.hi, len(ctx)), self.lo - 1, -1):
            key = tuple(ctx[len(ctx) - n :])
            if key not in self.index and (self.base is None or key not in self.base.index):
                continue
            for tok, share in self.ranked(key):
                if tok not in out:
                    out[tok] = weight * share
            if len(out) >= width:
                break
            weight *= 0.5
        return sorted(out.items(), key=lambda kv: -kv[1])[:width]

    def tree(self, tail: list[int], budget: TreeBudget) -> tuple[list[int], list[int]]:
        """Every distinct continuation as a branch, level by level (the ``width`` best of a level
        are expanded), best ``nodes`` by product of shares; returns ``(tokens, parents)``."""
        cands: list[tuple[float, int, int]] = []  # (score, token, parent candidate)
        frontier: list[tuple[int, list[int], float]] = [(-1, [], 1.0)]  # (candidate, path, score)
        for _ in range(budget.depth):
            level: list[tuple[int, list[int], float]] = []
            for ci, path, sc in frontier:
                for tok, share in self.branches(tail + path, budget.width):
                    cands.append((sc * share, tok, ci))
                    level.append((len(cands) - 1, path + [tok], sc * share))
            if not level:
                break
            frontier = sorted(level, key=lambda x: -x[2])[: budget.width]
        order = sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))[: budget.nodes]
        keep = sorted(order)  # parents (earlier, never lower score) before children
        new = {c: i for i, c in enumerate(keep)}
        return [cands[c][1] for c in keep], [new[cands[c][2]] if cands[c][2] >= 0 else -1 for c in keep]


class NGramDraft(StatelessDraft):
    """``NGramDraft(max_ngram=4, min_ngram=1, history_per_prompt=16, max_prompts=4096)``. Any
    tokenizer is served: it only copies token ids the policy already produced."""

    name: ClassVar[str] = "ngram"
    #: prompts whose indexed history is kept between rollouts
    BASE_POOLS: ClassVar[int] = 256

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
        #: rows (and groups) whose pool entry is built at their first proposal, not at reset
        self._row_prompt: dict[int, list[int]] = {}
        #: pools built (tests; a rollout the sampler decodes plainly builds none)
        self.pools_built = 0
        #: prompt -> its prompt and earlier completions indexed (LRU, at most ``BASE_POOLS``; completions
        #: observed since are indexed at the next use): a rollout's pools extend it without changing
        #: it, so a prompt's history is indexed once, not at every rollout that drafts
        self._base: OrderedDict[Key, _Pool] = OrderedDict()

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        """Remember each row's prompt; a group's pool (its prompt and earlier completions, indexed)
        is built at the first proposal for one of its rows: indexing every prompt at reset was a
        measurable share of a wide rollout that the cost model decodes plainly (the n-gram draft
        rarely pays there; docs/results.md, Sampler) -- now nothing."""
        self._pools, self._keys, self._row_sid, self._row_group, self._row_prompt = {}, {}, {}, {}, {}
        rows = zip(prompts.tolist(), prompt_mask.long().tolist(), group_index.tolist())
        for r, (ids, m, g) in enumerate(rows):
            prompt = [t for t, keep in zip(ids, m) if keep]
            self._keys.setdefault(g, tuple(prompt))
            self._row_prompt[r], self._row_group[r] = prompt, g

    def _row(self, r: int) -> tuple[_Pool, int]:
        """Row ``r``'s pool and sequence id, building the pool / adding the row on first use."""
        g = self._row_group[r]
        pool = self._pools.get(g)
        if pool is None:
            base = self._base_pool(self._keys[g])
            pool = self._pools[g] = _Pool(self.lo, self.hi, base.keep, base=base)
            self.pools_built += 1
        sid = self._row_sid.get(r)
        if sid is None:
            prompt = self._row_prompt[r]
            sid = self._row_sid[r] = pool.add(prompt, known=len(prompt))
        return pool, sid

    def _base_pool(self, key: Key) -> _Pool:
        """The prompt and its earlier completions, indexed (built once, then extended by the
        completions observed since; rebuilt when the oldest was dropped)."""
        base = self._base.get(key)
        if base is None:
            base = self._base[key] = _Pool(self.lo, self.hi)
            base.add(list(key))
            while len(self._base) > self.BASE_POOLS:
                self._base.popitem(last=False)
        self._base.move_to_end(key)
        hist = self.history.get(key, [])
        for old in hist[len(base.seqs) - 1 :]:  # completions observed since (sequence 0: the prompt)
            base.add(list(key) + old, known=len(key))
        return base

    def _sync(self, context: DraftContext) -> list[tuple[_Pool, list[int]]]:
        """Append each row's new tokens to its pool sequence; returns ``(pool, sequence)`` per row."""
        lengths = context.lengths.tolist()
        rows = [self._row(r) for r in context.rows.tolist()]
        # only the tail each row gained since the last call is converted to Python
        known = [len(pool.seqs[sid]) for pool, sid in rows]
        grow = max(1, max(n - s for n, s in zip(lengths, known)))
        tail_rows = context.tokens[:, -max(grow, self.hi) :].tolist()
        out = []
        for a, (pool, sid) in enumerate(rows):
            new = lengths[a] - known[a]
            if new > 0:
                pool.extend(sid, tail_rows[a][len(tail_rows[a]) - new :])
            out.append((pool, pool.seqs[sid]))
        return out

    def propose(
        self, context: DraftContext, num_tokens: int, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        out = torch.empty(context.tokens.shape[0], num_tokens, dtype=torch.long)
        for a, ((pool, seq), r) in enumerate(zip(self._sync(context), context.rows.tolist())):
            cont = pool.continuation(seq[-AGREE:], num_tokens, self._row_sid[r])
            fill = cont[-1] if cont else seq[-1]
            out[a] = torch.tensor(cont + [fill] * (num_tokens - len(cont)), dtype=torch.long)
        return DraftProposal(out.to(context.tokens.device), None)

    def propose_tree(
        self, context: DraftContext, budget: TreeBudget, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """Every distinct continuation the pool holds for the row's suffix is a branch (own text,
        siblings, earlier rollouts of the prompt), ranked by count and recency; rows with fewer
        than ``budget.nodes`` real nodes are padded with a chain repeating their last token."""
        n = budget.nodes
        toks = torch.empty(context.tokens.shape[0], n, dtype=torch.long)
        pars = torch.empty_like(toks)
        for a, (pool, seq) in enumerate(self._sync(context)):
            t, p = pool.tree(seq[-self.hi :], budget)
            fill = t[-1] if t else seq[-1]
            pad = n - len(t)
            toks[a] = torch.tensor(t + [fill] * pad, dtype=torch.long)
            pars[a] = torch.tensor(p + list(range(len(t) - 1, len(t) - 1 + pad)), dtype=torch.long)
        dev = context.tokens.device
        return DraftProposal(toks.to(dev), None, pars.to(dev))

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
            if len(hist) > self.history_per_prompt:  # the oldest goes: index the prompt anew
                del hist[: -self.history_per_prompt]
                self._base.pop(key, None)
            self.history.move_to_end(key)
        while len(self.history) > self.max_prompts:
            self._base.pop(self.history.popitem(last=False)[0], None)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [(list(k), v) for k, v in self.history.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "history" not in state:
            raise GRPOPartsError(f"state: expected a 'history' entry, got keys {sorted(state)}")
        self.history = OrderedDict((tuple(k), [list(c) for c in v]) for k, v in state["history"])
        self._base = OrderedDict()
