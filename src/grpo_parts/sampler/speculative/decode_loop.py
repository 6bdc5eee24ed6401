"""The speculative sampler's decode loop state: one rollout's buffers and the rows still generating."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...compat import cache_kwarg, crop_cache, output_cache, repeat_cache_rows
from ...core import token_logprobs
from ...decoding import (
    CACHE_ROOM,
    SamplingParams,
    compact_block,
    compact_cache,
    drop_cache_rows,
    reserve_cache_room,
    right_align,
    sample_tokens,
    tree_ancestors,
    tree_attention_mask,
)
from ...draft.protocol import DraftContext
from ...errors import GRPOPartsError
from ...types import PromptBatch
from .decode_attention import LAYOUT_KWARG, DecodeLayout
from .lean_forward import LeanForward
from .tree_verify import TreeVerifier
from .verify import Verifier


@dataclass
class DecodeState:
    """Buffers of all ``N`` rows (``seq: [N, P + T]``, ``logps: [N, T]``, ``emitted``, ``done``) and
    the active rows' state (``act``: rollout row ids in cache order; ``mask``: the cache's
    attention mask; ``next_pos``, ``last``; ``h_parts``/``num_new``: policy features not yet fed to
    the draft, as right-aligned pieces concatenated lazily so plain steps only append)."""

    model: Any
    params: SamplingParams
    need_h: bool
    ids: torch.Tensor
    pmask: torch.Tensor
    group: torch.Tensor
    seq: torch.Tensor
    logps: torch.Tensor
    emitted: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor
    cache: Any
    act: torch.Tensor
    mask: torch.Tensor
    next_pos: torch.Tensor
    last: torch.Tensor
    num_new: torch.Tensor
    h_parts: list[torch.Tensor] = field(default_factory=list)
    cache_kw: str = "past_key_values"
    #: sliding attention window of the policy (None: none); the cache is compacted before a
    #: forward would pass ``window - 1`` columns, so the window never drops or hides a live entry
    window: int | None = None
    dtype: torch.dtype = torch.float32  # the policy's (tree attention masks are built in it)
    #: cache layers that append in place (``compat.reserve_cache_room``; 0: every step copies the cache)
    room_layers: int = 0
    #: the shared-prompt decode attention's layout (None: the policy's own attention), rebuilt when
    #: the active rows change; the first ``width`` cache columns (the prompt) are never moved
    layout: DecodeLayout | None = None
    layout_act: torch.Tensor | None = None
    #: the lean forward (None: the model's own forward); forwards per path so far
    lean: LeanForward | None = None
    forwards: dict[str, int] = field(default_factory=lambda: {"lean": 0, "model": 0})

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @property
    def tmax(self) -> int:
        return self.params.max_new_tokens

    @classmethod
    def prefill(
        cls, model: Any, prompts: PromptBatch, params: SamplingParams,
        expanded: tuple[torch.Tensor, torch.Tensor, torch.Tensor], need_h: bool,
        generator: torch.Generator | None,
    ) -> DecodeState:  # fmt: skip
        """Prefill each prompt once and copy its cache to its G rows (the group shares the prompt,
        as in Prefix Grouper and vLLM's prefix caching); positions count real tokens only (left
        padding), as in the reference sampler. Samples every row's first token."""
        ids, pmask, group = expanded
        device = ids.device
        n, g, tmax = ids.shape[0], params.group_size, params.max_new_tokens
        u_ids, u_mask = prompts.input_ids.to(device), prompts.attention_mask.long().to(device)
        out = model(
            input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True, output_hidden_states=need_h, logits_to_keep=1,
        )  # fmt: skip
        cache, logits0 = output_cache(out), out.logits[:, -1].repeat_interleave(g, 0)
        if g > 1:
            repeat_cache_rows(cache, g)
        room = reserve_cache_room(cache, CACHE_ROOM)
        first = sample_tokens(logits0, params, generator)
        pad = torch.full((n, tmax), params.pad_token_id, device=device, dtype=ids.dtype)
        seq = torch.cat([ids, pad], 1)
        ldt = logits0.dtype if logits0.dtype == torch.float64 else torch.float32
        logps = torch.zeros(n, tmax, dtype=ldt).to(device)
        seq[:, ids.shape[1]] = first
        logps[:, 0] = token_logprobs(logits0, first, params.logprob_temperature)
        emitted = torch.ones(n, dtype=torch.long, device=device)
        eos = torch.tensor(params.eos_token_ids or (-1,), device=device)
        plen = pmask.sum(-1)
        return cls(
            model=model, params=params, need_h=need_h, ids=ids, pmask=pmask, group=group, seq=seq,
            logps=logps, emitted=emitted, done=torch.isin(first, eos) | (emitted >= tmax), eos=eos,
            cache=cache, act=torch.arange(n, device=device), mask=pmask.long(), next_pos=plen.clone(),
            last=first, num_new=plen.clone(),
            h_parts=[out.hidden_states[-1].repeat_interleave(g, 0)] if need_h else [],
            cache_kw=cache_kwarg(model), dtype=next(model.parameters()).dtype, room_layers=room,
        )  # fmt: skip

    def drop_finished(self) -> bool:
        """Remove finished rows from the active state and the cache; False when none is left."""
        keep = ~self.done[self.act]
        if bool(keep.all()):
            return True
        if not bool(keep.any()):
            self.act = self.act[:0]
            return False
        # live rows from the end of the batch take the finished rows' slots: the cache moves those
        # rows only instead of gathering every row of every layer (rows change order; every per-row
        # tensor, the draft and the decode layout follow ``act``)
        sel = drop_cache_rows(self.cache, keep)
        self.act, self.mask, self.next_pos = self.act[sel], self.mask[sel], self.next_pos[sel]
        self.last, self.num_new = self.last[sel], self.num_new[sel]
        self.h_parts = [torch.cat(self.h_parts, 1)[sel]] if self.h_parts else []
        return True

    def remaining(self) -> int:
        """The most tokens an active row may still emit."""
        return int((self.tmax - self.emitted[self.act]).max())

    def forward(self, inp: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> Any:
        """One cached policy forward of ``inp: [A, T]`` (the lean forward where it serves the
        policy); updates the cache."""
        extra: dict[str, Any] = {}
        if self.layout is not None:
            if self.layout_act is not self.act:
                self.layout = self.layout.for_rows(self.group[self.act])
                self.layout_act = self.act
            self.layout.choose(inp.shape[1])
            extra[LAYOUT_KWARG] = self.layout
        if self.lean is not None:  # same maths, without the framework's per-forward overhead
            self.forwards["lean"] += 1
            return self.lean(inp, mask, pos, self.cache, self.need_h, extra)
        self.forwards["model"] += 1
        extra[self.cache_kw] = self.cache
        out = self.model(
            input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True,
            output_hidden_states=self.need_h, **extra,
        )  # fmt: skip
        self.cache = output_cache(out)
        return out

    def plain_step(self, generator: torch.Generator | None) -> None:
        """One token per active row (speculation off)."""
        params, act = self.params, self.act
        self.fit_window(1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        out = self.forward(self.last[:, None], self.mask, self.next_pos[:, None])
        logits = out.logits[:, -1]
        self.last = sample_tokens(logits, params, generator)
        e = self.emitted[act]
        self.seq[act, self.width + e] = self.last
        lp = token_logprobs(logits, self.last, params.logprob_temperature)
        self.logps[act, e] = lp.to(self.logps.dtype)
        self.emitted[act] = e + 1
        self.done[act] = torch.isin(self.last, self.eos) | (e + 1 >= self.tmax)
        self.next_pos = self.next_pos + 1
        # the draft has not seen these features yet: accumulate them (right-aligned) for its next call
        self.num_new = self.num_new + 1
        if self.need_h:
            self.h_parts.append(out.hidden_states[-1])

    def draft_context(self) -> DraftContext:
        """The active rows as the draft sees them (right-aligned tokens, unseen policy features)."""
        act, e = self.act, self.emitted[self.act]
        h = self.h_parts
        new_h = torch.cat(h, 1) if len(h) > 1 else (h[0] if h else None)
        self.h_parts = [new_h] if new_h is not None else []
        plen = self.pmask.sum(-1)
        return DraftContext(
            tokens=right_align(self.seq[act], self.width + e, self.width + int(e.max()), self.params.pad_token_id),
            lengths=plen[act] + e, rows=act, group_index=self.group[act],
            hidden=None if new_h is None else new_h[:, -1], new_hidden=new_h,
            num_new=None if new_h is None else self.num_new,
        )  # fmt: skip

    def emit(self, path: torch.Tensor, lp: torch.Tensor, n_acc: torch.Tensor) -> torch.Tensor:
        """Write each active row's emitted tokens ``path: [A, D]`` (valid ``j <= n_acc``) with their
        log-probs ``lp: [A, D]``, cut after an EOS and at ``max_new_tokens``; returns how many each
        row kept (``take: [A]``) and marks finished rows."""
        act, d = self.act, path.shape[1]
        j = torch.arange(d, device=path.device)
        valid = j[None, :] <= n_acc[:, None]
        is_eos = torch.isin(path, self.eos) & valid
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(n_acc, d))
        e = self.emitted[act]
        take = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), self.tmax - e)
        wmask = j[None, :] < take[:, None]
        cols = (e[:, None] + j[None, :]).clamp(max=self.tmax - 1)
        rows2 = act[:, None].expand_as(cols)
        self.seq[rows2[wmask], self.width + cols[wmask]] = path[wmask]
        self.logps[rows2[wmask], cols[wmask]] = lp[wmask].to(self.logps.dtype)
        self.emitted[act] += take
        self.done[act] = (first_eos < take) | (self.emitted[act] >= self.tmax)
        return take

    def verify_chain(
        self, tokens: torch.Tensor, probs: torch.Tensor | None, verifier: Verifier,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Score ``[last, d_1 .. d_k]`` in one cached forward, verify the chain ``tokens: [A, k]``
        (drawn from ``probs``, None = point masses), emit. Returns ``(n_acc, take)``."""
        params, k = self.params, tokens.shape[1]
        inp = torch.cat([self.last[:, None], tokens], 1)
        self.fit_window(k + 1)
        self.mask = torch.cat([self.mask, torch.ones_like(inp)], 1)
        pos = self.next_pos[:, None] + torch.arange(k + 1, device=inp.device)
        out = self.forward(inp, self.mask, pos)
        logits = out.logits
        n_acc, nxt = verifier(logits, tokens, probs, params, generator)
        j = torch.arange(k + 1, device=inp.device)
        chain = torch.cat([tokens, nxt[:, None]], 1)
        chain = torch.where(j[None, :] == n_acc[:, None], nxt[:, None], chain)  # [A, k+1], valid j <= n
        lp = token_logprobs(logits, chain, params.logprob_temperature)
        take = self.emit(chain, lp, n_acc)
        # the rejected tokens' KV entries become holes; the next step starts after the accepted ones
        self.mask[:, -(k + 1) :] = (j[None, :] <= n_acc[:, None]).long()
        self.next_pos = self.next_pos + n_acc + 1
        self.last, self.num_new = nxt, n_acc + 1
        if self.need_h:
            self.h_parts = [right_align(out.hidden_states[-1], n_acc + 1, k + 1, 0.0)]
        return n_acc, take

    def verify_tree(
        self, tokens: torch.Tensor, parents: torch.Tensor, verifier: TreeVerifier,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:  # fmt: skip
        """Score every node of each row's tree ``tokens/parents: [A, N]`` in one cached forward
        (tree attention mask over the cache, position = the row's next position + node depth),
        verify, emit. Only the accepted path's KV entries stay: they are moved to the front of the
        block and the rest cropped (or left as holes). Returns ``(n_acc, take, (depth, width))``,
        the last two the deepest level and the most children of one node over the rows."""
        params, (a, n) = self.params, tokens.shape
        anc = tree_ancestors(parents)  # [A, N+1, N+1], column 0 = the root (last token)
        depth = anc.sum(-1) - 1
        inp = torch.cat([self.last[:, None], tokens], 1)
        self.fit_window(n + 1)
        am = tree_attention_mask(self.mask, anc, self.dtype)
        self.mask = torch.cat([self.mask, torch.ones_like(inp)], 1)
        out = self.forward(inp, am, self.next_pos[:, None] + depth)
        logits = out.logits
        n_acc, path, nxt = verifier(logits, tokens, parents, params, generator)
        d = path.shape[1]
        j = torch.arange(d + 1, device=inp.device)
        root = torch.zeros(a, 1, dtype=torch.long, device=inp.device)
        src = torch.cat([root, path], 1)  # predicted token j
        emitted = torch.where(j[None, :] == n_acc[:, None], nxt[:, None], inp.gather(1, src.roll(-1, 1)))
        lg = logits.gather(1, src[..., None].expand(-1, -1, logits.shape[-1]))
        lp = token_logprobs(lg, emitted, params.logprob_temperature)
        take = self.emit(emitted, lp, n_acc)
        # keep the path's entries (root + accepted nodes) at the front of the block, in order
        on_path = j[None, :] <= n_acc[:, None]
        c = torch.arange(n + 1, device=inp.device)
        rank = torch.full((a, n + 1), n + 1, dtype=torch.long, device=inp.device) + c
        rank.scatter_(1, torch.where(on_path, src, 0), torch.where(on_path, j[None, :], 0).expand(a, -1))
        order = rank.argsort(1)
        if compact_block(self.cache, order, keep=int(n_acc.max()) + 1):
            self.mask[:, -(n + 1) :] = (c[None, :] <= n_acc[:, None]).long()
        else:  # no per-layer keys to move: the rejected nodes stay as holes
            kept = torch.zeros(a, n + 1, dtype=torch.long, device=inp.device)
            self.mask[:, -(n + 1) :] = kept.scatter_(1, torch.where(on_path, src, 0), 1)
        self.next_pos = self.next_pos + n_acc + 1
        self.last, self.num_new = nxt, n_acc + 1
        if self.need_h:
            h = out.hidden_states[-1]
            h = h.gather(1, src[..., None].expand(-1, -1, h.shape[-1]))
            self.h_parts = [right_align(h, n_acc + 1, d + 1, 0.0)]
        kids = torch.zeros(a, n + 1, dtype=torch.long, device=inp.device)
        kids.scatter_add_(1, parents + 1, torch.ones_like(parents))
        return n_acc, take, (int(depth.max()), int(kids.max()))

    def window_room(self) -> int:
        """The longest draft a step may verify under the sliding window (after compaction)."""
        if self.window is None:
            return 1 << 30
        return self.window - 2 - int(self.mask.sum(-1).max())

    def fit_window(self, new: int) -> None:
        """Compact the cache when ``new`` more columns would pass the sliding window's ``W - 1``."""
        if self.window is None or self.mask.shape[1] + new <= self.window - 1:
            return
        compacted = compact_cache(self.cache, self.mask)
        if compacted is None or compacted.shape[1] + new > self.window - 1:
            raise GRPOPartsError(
                f"sliding window {self.window}: cannot fit {new} new columns after {self.mask.shape[1]} "
                f"(compacted: {None if compacted is None else compacted.shape[1]})"
            )
        self.mask = compacted

    def release(self, num_rejected: torch.Tensor, compact_waste: float) -> None:
        """Crop the cache columns every surviving row rejected (``num_rejected: [A]`` trailing
        holes per row); compact when holes exceed ``compact_waste`` of the cache."""
        live = ~self.done[self.act]
        if not bool(live.any()):
            return
        c = int(num_rejected[live].min())
        if c > 0:
            crop_cache(self.cache, self.mask.shape[1] - c)
            self.mask = self.mask[:, :-c]
        tail = self.mask[:, self.width :]  # the prompt's columns stay in place (decode attention)
        if float(tail.sum(-1).max()) < (1 - compact_waste) * tail.shape[1]:
            compacted = compact_cache(self.cache, self.mask, start=self.width)
            self.mask = self.mask if compacted is None else compacted

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``completions [N, T]``, ``logps [N, T]``, ``emitted [N]``."""
        return self.seq[:, self.width :], self.logps, self.emitted
