"""Concurrency-aware speculative sampler (FastGRPO, arXiv 2509.21792), lossless and batched.

Per step, for the ``A`` rows still generating:

1. the :class:`~.cost_model.CostModel` picks a draft length ``k`` from ``A`` and the online
   acceptance estimate (``k = 0`` is plain decoding: speculation off where it would not pay);
2. the draft proposes ``k`` tokens per row; the policy scores ``[last, d_1 .. d_k]`` in one cached
   forward; :func:`~.verify.verify_chain` accepts a prefix of each row's chain by residual rejection
   sampling and draws one more token (correction or bonus), so each row emits ``n_a + 1`` tokens;
3. EOS inside the emitted chain stops the row there, and no row emits more than
   ``max_new_tokens``; finished rows leave the batch (and both KV caches) at once.

**Per-row acceptance without filler.** Rows accept different counts. The KV entries of rejected
tokens stay in the policy's cache as *holes*: their attention-mask column is set to 0, and every
forward passes explicit ``position_ids`` (a row's next position is its own real length), so a hole
is invisible to attention and never shifts positions. Columns that every row rejected are cropped
at once; when holes exceed ``compact_waste`` of the cache it is compacted (each row's live entries
gathered to the right). No row ever computes or attends to another row's filler.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..compat import cache_kwarg, crop_cache, output_cache, repeat_cache_rows, select_cache_rows
from ..core import token_logprobs
from ..draft.protocol import DraftContext, DraftModel, DraftTrainingBatch
from ..errors import GRPOPartsError, NotSupportedError
from .cost_model import AcceptanceEstimate, CostModel, batch_grid, calibrate_policy, token_grid
from .logits import sample_tokens
from .protocol import PromptBatch, Rollout, SamplingParams
from .reference import check_model, completion_mask_from_eos, expand_prompts
from .trace import DecodeTrace
from .verify import Verifier, compact_cache, right_align, verify_chain


class SpeculativeConfig(BaseModel):
    """``draft_tokens`` fixes ``k`` (no cost model: for tests and ablations); otherwise ``k`` is
    chosen per step in ``0 .. max_draft_tokens``. ``train_draft``: after each rollout, call the
    draft's ``update`` (online learning) when it is learnable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_draft_tokens: int = Field(6, ge=1, le=32)
    draft_tokens: int | None = Field(None, ge=0, le=32)
    calibrate_repeats: int = Field(2, ge=1)
    acceptance_prior: float = Field(0.6, gt=0.0, lt=1.0)
    acceptance_decay: float = Field(0.98, gt=0.0, le=1.0)
    probe_every: int = Field(
        16,
        ge=1,
        description="when speculation is off for low acceptance, try k=1 after this many steps "
        "(the gap doubles after each probe that does not switch speculation back on)",
    )
    compact_waste: float = Field(
        0.5, gt=0.0, description="compact the policy cache when holes exceed this fraction"
    )
    train_draft: bool = True


class SpeculativeSampler:
    """``SpeculativeSampler(policy, draft)``; ``generate`` follows the ``Sampler`` Protocol."""

    name: ClassVar[str] = "speculative"

    def __init__(
        self,
        model: torch.nn.Module,
        draft: DraftModel,
        config: SpeculativeConfig | None = None,
        verifier: Verifier = verify_chain,
    ):
        reasons = check_model(model)
        if reasons:
            raise GRPOPartsError("; ".join(reasons))
        self.model, self.draft, self.config, self.verifier = (
            model,
            draft,
            config or SpeculativeConfig(),
            verifier,
        )
        self.acceptance = AcceptanceEstimate(self.config.acceptance_prior, decay=self.config.acceptance_decay)
        self.cost: CostModel | None = None
        self.last_draft_metrics: dict[str, float] = {}
        self.last_trace = DecodeTrace()  # per decode step of the last rollout: rows, k, tokens, why
        self._steps = self._last_probe = 0
        self._probe_gap = self.config.probe_every

    # ------------------------------------------------------------------ Sampler protocol
    def not_supported_reasons(self, params: SamplingParams) -> list[str]:
        reasons = check_model(self.model)
        if reasons:
            return reasons
        cfg: Any = self.model.config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            reasons.append(
                f"model: sliding-window attention (sliding_window={cfg.sliding_window}) is not supported: "
                "cache holes would count against the window"
            )
        return reasons + self.draft.not_supported_reasons(self.model, params)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        if policy is not self.model:
            self.model = policy
            self.cost = None  # a different module may cost differently
        self.draft.bind_policy(policy)

    def calibrate(self, max_rows: int, context_len: int, params: SamplingParams) -> CostModel:
        """Measure policy verification cost (``A x T`` grid) and draft cost on this machine."""
        sizes = batch_grid(max_rows)
        toks = token_grid(self.config.max_draft_tokens + 1)
        table = calibrate_policy(self.model, sizes, toks, context_len, self.config.calibrate_repeats)
        cost = CostModel(sizes, toks, table)
        self._calibrate_draft(cost, sizes, context_len, params)
        self.cost = cost
        return cost

    @torch.no_grad()
    def _calibrate_draft(self, cost: CostModel, sizes: list[int], ctx: int, params: SamplingParams) -> None:
        device = next(self.model.parameters()).device
        vocab = int(self.model.get_output_embeddings().weight.shape[0])  # type: ignore[operator, union-attr]
        hid = int(getattr(self.model, "config").hidden_size)  # noqa: B009
        gen = torch.Generator(device="cpu").manual_seed(0)
        kmax, reps = self.config.max_draft_tokens, self.config.calibrate_repeats
        for a in sizes:
            toks = torch.randint(1, vocab, (a, ctx + 2 * reps + 2), generator=gen).to(device)
            rows = torch.arange(a, device=device)
            self.draft.reset(toks[:, :ctx], torch.ones_like(toks[:, :ctx]), rows)

            def context(
                length: int, new: int, toks: torch.Tensor = toks, rows: torch.Tensor = rows
            ) -> DraftContext:
                na = toks.shape[0]
                h = (
                    torch.randn(na, new, hid, generator=gen).to(device)
                    if self.draft.needs_hidden_states
                    else None
                )
                return DraftContext(
                    toks[:, :length], torch.full((na,), length, device=device), rows, rows,
                    hidden=None if h is None else h[:, -1], new_hidden=h,
                    num_new=None if h is None else torch.full((na,), new, device=device),
                )  # fmt: skip

            self.draft.propose(context(ctx, ctx), 1, params, None)  # warm-up / prefill
            times = {1: float("inf"), kmax: float("inf")}
            for i in range(reps):
                for j, k in enumerate(times):
                    c = context(ctx + 1 + 2 * i + j, 1)
                    t0 = time.perf_counter()
                    self.draft.propose(c, k, params, None)
                    times[k] = min(times[k], time.perf_counter() - t0)
            per = max((times[kmax] - times[1]) / max(kmax - 1, 1), 1e-7)
            cost.draft_fixed[a] = max(times[1] - per, 1e-7)
            cost.draft_per_token[a] = per

    def choose_k(self, active: int, remaining: int, step: int) -> int:
        """Draft length for this step (at most ``remaining - 1``: the step always emits one more)."""
        cap = min(self.config.max_draft_tokens, remaining - 1)
        if cap <= 0:
            return 0
        if self.config.draft_tokens is not None:
            return min(self.config.draft_tokens, cap)
        assert self.cost is not None
        k = self.cost.choose(active, self.acceptance.rate, cap)
        self._steps += 1
        if k > 0:
            self._probe_gap = self.config.probe_every
        elif (
            self._steps - self._last_probe >= self._probe_gap
            and self.cost.break_even_acceptance(active) < 1.0
        ):
            # speculation is off only for low acceptance: probe so a better draft is noticed, backing
            # off exponentially while probes keep failing (so "off" costs next to nothing)
            k, self._last_probe = 1, self._steps
            self._probe_gap = min(2 * self._probe_gap, 1024)
        return k

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        # inference_mode skips autograd bookkeeping in every decode step (as the reference sampler
        # does); its tensors cannot enter autograd, so the outputs are cloned out of it before the
        # rollout is assembled and the draft trains on it.
        with torch.inference_mode():
            parts = self._decode(prompts, params, generator)
        parts = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in parts)
        with torch.no_grad():
            return self._finish(*parts)

    def _decode(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[Any, ...]:
        reasons = self.not_supported_reasons(params)
        if reasons:
            raise NotSupportedError(self.name, reasons)
        model, draft = self.model, self.draft
        device = next(model.parameters()).device
        ids, pmask, group = (t.to(device) for t in expand_prompts(prompts, params.group_size))
        n, width = ids.shape
        tmax = params.max_new_tokens
        if self.config.draft_tokens is None and (self.cost is None or max(self.cost.batch_sizes) < n):
            self.calibrate(n, width + tmax // 2, params)
        eos = torch.tensor(params.eos_token_ids or (-1,), device=device)
        need_h = draft.needs_hidden_states
        draft.reset(ids, pmask, group)

        # prefill each prompt once and copy its cache to its G rows (the group shares the prompt, as
        # in Prefix Grouper and vLLM's prefix caching); positions count real tokens only (left
        # padding), as in the reference sampler
        g = params.group_size
        u_ids, u_mask = prompts.input_ids.to(device), prompts.attention_mask.long().to(device)
        out = model(
            input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True, output_hidden_states=need_h, logits_to_keep=1,
        )  # fmt: skip
        cache, logits0 = output_cache(out), out.logits[:, -1].repeat_interleave(g, 0)
        cache_kw = cache_kwarg(model)
        if g > 1:
            repeat_cache_rows(cache, g)
        first = sample_tokens(logits0, params, generator)
        seq = torch.cat([ids, torch.full((n, tmax), params.pad_token_id, device=device, dtype=ids.dtype)], 1)
        logps = torch.zeros(n, tmax, dtype=logits0.dtype if logits0.dtype == torch.float64 else torch.float32)
        logps = logps.to(device)
        seq[:, width] = first
        logps[:, 0] = token_logprobs(logits0, first, params.logprob_temperature)
        emitted = torch.ones(n, dtype=torch.long, device=device)
        plen = pmask.sum(-1)

        # per active row state (``act`` = rollout row ids, in cache order)
        done = torch.isin(first, eos) | (emitted >= tmax)
        act = torch.arange(n, device=device)
        mask, next_pos, last = pmask.long(), plen.clone(), first
        # policy features the draft has not seen yet, as right-aligned chunks (concatenated lazily:
        # a plain step only appends, so a long run of plain steps costs no O(T^2) copying)
        h_parts: list[torch.Tensor] = [out.hidden_states[-1].repeat_interleave(g, 0)] if need_h else []
        num_new = plen.clone()
        stats = dict(
            verify_steps=0.0, plain_steps=0.0, drafted=0.0, accepted=0.0, emitted_spec=0.0, row_verifies=0.0
        )
        step, trace = 0, DecodeTrace()
        self.last_trace = trace
        while True:
            keep = ~done[act]
            if not bool(keep.all()):
                sel = keep.nonzero().squeeze(1)
                act, mask, next_pos, last, num_new = (
                    act[sel],
                    mask[sel],
                    next_pos[sel],
                    last[sel],
                    num_new[sel],
                )
                h_parts = [torch.cat(h_parts, 1)[sel]] if h_parts else []
                if act.numel() == 0:
                    break
                select_cache_rows(cache, sel)
            a = act.numel()
            t_step, t_draft = time.perf_counter(), 0.0
            remaining = int((tmax - emitted[act]).max())
            k = self.choose_k(a, remaining, step)
            step += 1
            if k == 0:  # plain decoding step, as lean as the reference sampler's
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                out = model(
                    input_ids=last[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    use_cache=True, output_hidden_states=need_h, **{cache_kw: cache},
                )  # fmt: skip
                cache, logits = output_cache(out), out.logits[:, -1]
                last = sample_tokens(logits, params, generator)
                e = emitted[act]
                seq[act, width + e] = last
                logps[act, e] = token_logprobs(logits, last, params.logprob_temperature).to(logps.dtype)
                emitted[act] = e + 1
                done[act] = torch.isin(last, eos) | (e + 1 >= tmax)
                next_pos = next_pos + 1
                # the draft has not seen these features yet: accumulate them (right-aligned) for its next call
                num_new = num_new + 1
                if need_h:
                    h_parts.append(out.hidden_states[-1])
                stats["plain_steps"] += 1
                if self.cost is not None:
                    self.cost.observe_step(a, 0, time.perf_counter() - t_step, 0.0)
                trace.record(a, 0, 1.0, self.acceptance.rate, self.cost)
                continue
            d_tok = torch.empty(a, 0, dtype=torch.long, device=device)
            d_prob = None
            if k > 0:
                e = emitted[act]
                new_h = torch.cat(h_parts, 1) if len(h_parts) > 1 else (h_parts[0] if h_parts else None)
                h_parts = [new_h] if new_h is not None else []
                ctx_w = width + int(e.max())
                ctx = DraftContext(
                    tokens=right_align(seq[act], width + e, ctx_w, params.pad_token_id),
                    lengths=plen[act] + e, rows=act, group_index=group[act],
                    hidden=None if new_h is None else new_h[:, -1], new_hidden=new_h,
                    num_new=None if new_h is None else num_new,
                )  # fmt: skip
                t0 = time.perf_counter()
                prop = draft.propose(ctx, k, params, generator)
                t_draft = time.perf_counter() - t0
                if self.cost is not None:
                    self.cost.observe_draft(a, k, t_draft)
                d_tok, d_prob = prop.tokens, prop.probs
            inp = torch.cat([last[:, None], d_tok], 1)
            mask = torch.cat([mask, torch.ones_like(inp)], 1)
            pos = next_pos[:, None] + torch.arange(k + 1, device=device)
            out = model(
                input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True,
                output_hidden_states=need_h, **{cache_kw: cache},
            )  # fmt: skip
            cache, logits = output_cache(out), out.logits
            n_acc, nxt = self.verifier(logits, d_tok, d_prob, params, generator)
            j = torch.arange(k + 1, device=device)
            chain = torch.cat([d_tok, nxt[:, None]], 1)
            chain = torch.where(j[None, :] == n_acc[:, None], nxt[:, None], chain)  # [A, k+1], valid j <= n
            lp = token_logprobs(logits, chain, params.logprob_temperature)
            # how many of the n+1 tokens each row keeps: stop after EOS and at max_new_tokens
            valid = j[None, :] <= n_acc[:, None]
            is_eos = torch.isin(chain, eos) & valid
            first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(n_acc, k + 1))
            take = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), tmax - emitted[act])
            wmask = j[None, :] < take[:, None]
            cols = (emitted[act][:, None] + j[None, :]).clamp(max=tmax - 1)
            rows2 = act[:, None].expand_as(cols)
            seq[rows2[wmask], width + cols[wmask]] = chain[wmask]
            logps[rows2[wmask], cols[wmask]] = lp[wmask].to(logps.dtype)
            emitted[act] += take
            done[act] = (first_eos < take) | (emitted[act] >= tmax)
            # bookkeeping for the next step
            trace.record(a, k, float(take.float().mean()), self.acceptance.rate, self.cost)
            if k > 0:
                self.acceptance.update(n_acc, k)
                stats["verify_steps"] += 1
                stats["drafted"] += k * a
                stats["accepted"] += float(n_acc.sum())
                stats["emitted_spec"] += float(take.sum())
                stats["row_verifies"] += a
            else:
                stats["plain_steps"] += 1
            mask[:, -(k + 1) :] = valid.long()
            next_pos = next_pos + n_acc + 1
            last = nxt
            num_new = n_acc + 1
            if need_h:
                h_parts = [right_align(out.hidden_states[-1], n_acc + 1, k + 1, 0.0)]
            live = ~done[act]
            if bool(live.any()):
                c = int((k - n_acc)[live].min())  # columns every surviving row rejected
                if c > 0:
                    crop_cache(cache, mask.shape[1] - c)
                    mask = mask[:, :-c]
                if float(mask.sum(-1).max()) < (1 - self.config.compact_waste) * mask.shape[1]:
                    compacted = compact_cache(cache, mask)
                    mask = mask if compacted is None else compacted
            if self.cost is not None:  # the whole step, cache housekeeping included
                self.cost.observe_step(a, k, time.perf_counter() - t_step, t_draft)
        return ids, pmask, group, seq[:, width:], logps, emitted, params, prompts.num_prompts, stats

    def _finish(
        self, ids: torch.Tensor, pmask: torch.Tensor, group: torch.Tensor, comp: torch.Tensor, logps: torch.Tensor,
        emitted: torch.Tensor, params: SamplingParams, num_prompts: int, stats: dict[str, float],
    ) -> Rollout:  # fmt: skip
        t = int(emitted.max())
        comp, logps = comp[:, :t], logps[:, :t]
        cmask = completion_mask_from_eos(comp, params.eos_token_ids)
        cmask = cmask * (torch.arange(t, device=comp.device)[None, :] < emitted[:, None]).long()
        rollout = Rollout(
            prompt_ids=ids, prompt_mask=pmask, completion_ids=comp.masked_fill(cmask == 0, params.pad_token_id),
            completion_mask=cmask, logprobs=logps.masked_fill(cmask == 0, 0.0), group_index=group,
            num_prompts=num_prompts,
        )  # fmt: skip
        rv = max(stats["row_verifies"], 1.0)
        out_stats = {
            "accepted_per_verify": stats["emitted_spec"] / rv if stats["row_verifies"] else 1.0,
            "draft_accept_rate": stats["accepted"] / max(stats["drafted"], 1.0),
            "mean_draft_tokens": stats["drafted"] / rv,
            "verify_steps": stats["verify_steps"],
            "plain_steps": stats["plain_steps"],
            "acceptance_estimate": self.acceptance.rate,
        }
        self.draft.observe(rollout.completion_ids, rollout.completion_mask, group)
        if self.config.train_draft and self.draft.learnable:
            t0 = time.perf_counter()
            metrics = self.draft.update(self.draft_training_batch(rollout))
            out_stats["draft_update_s"] = time.perf_counter() - t0
            out_stats.update({f"draft_{k}": float(v) for k, v in metrics.items()})
        rollout.stats.update(out_stats)
        return rollout

    @torch.no_grad()
    def draft_training_batch(self, rollout: Rollout) -> DraftTrainingBatch:
        """One plain forward of the policy over prompt + completion: its last hidden states and
        logits at every position, ``loss_mask`` = positions whose next token the policy emitted."""
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        attn = torch.cat([rollout.prompt_mask.long(), rollout.completion_mask.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True)
        p = rollout.prompt_ids.shape[1]
        loss_mask = torch.zeros_like(attn)
        loss_mask[:, p - 1 : p - 1 + rollout.completion_ids.shape[1]] = rollout.completion_mask.long()
        return DraftTrainingBatch(ids, loss_mask, out.hidden_states[-1], out.logits, attention_mask=attn)
