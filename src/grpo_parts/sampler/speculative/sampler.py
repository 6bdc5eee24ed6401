"""Concurrency-aware speculative sampler (FastGRPO, arXiv 2509.21792), lossless and batched.

Per step, for the rows still generating: the cost model picks a draft length (0 = plain decoding),
the policy scores the draft in one cached forward, :mod:`.verify` accepts a prefix per row, and
finished rows leave the batch and both KV caches. Rejected tokens stay in the cache as masked
*holes* with explicit ``position_ids``, so rows accept different counts without filler.
docs/speculative.md, "What one step does" and "Per-row acceptance: holes, not filler".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch

from ...compat import own_attention_selected
from ...decoding import collector_paused
from ...draft.protocol import DraftModel, DraftTrainingBatch, TreeBudget, TreeDraftModel
from ...errors import NotSupportedError
from ...wrappers import inner_model
from .. import stats as keys
from ..protocol import PromptBatch, Rollout, SamplingParams, image_prompt_reasons
from ..reference import check_model, completion_mask_from_eos, expand_prompts, padded_rollout
from .acceptance import AcceptanceEstimate
from .calibration import calibrate, calibration_context
from .config import SpeculativeConfig
from .cost_model import CostModel
from .decode_attention import decode_attention_reasons, shared_prompt_decoding
from .decode_loop import DecodeState
from .lean_forward import lean_forward_for, lean_forward_reasons
from .model_support import recurrent_reasons, sharded_reasons, sliding_window, window_reason
from .refusals import PathRefusals
from .trace import DecodeTrace
from .tree_cost import TreeAcceptance, TreeCost, best_tree, choose_plan, tree_step_time
from .tree_verify import SampledTreeVerifier, TreeVerifier, verify_sampled_tree, verify_tree
from .verify import Verifier, verify_chain

log = logging.getLogger("grpo_parts.sampler")
__all__ = ["SpeculativeConfig", "SpeculativeSampler"]


class SpeculativeSampler:
    """``SpeculativeSampler(policy, draft)``; ``generate`` follows the ``Sampler`` Protocol. A policy
    wrapped by DDP or ZeRO-0/1/2 decodes with its inner model, each rank on its own; sharded weights
    are refused (:func:`.model_support.sharded_reasons`)."""

    name: ClassVar[str] = "speculative"

    def __init__(
        self, model: torch.nn.Module, draft: DraftModel, config: SpeculativeConfig | None = None,
        verifier: Verifier = verify_chain, tree_verifier: TreeVerifier = verify_tree,
        sampled_tree_verifier: SampledTreeVerifier = verify_sampled_tree,
    ):  # fmt: skip
        reasons = check_model(model) or sharded_reasons(model) or recurrent_reasons(inner_model(model))
        if not reasons and config is not None and config.lean_forward == "on":
            reasons = lean_forward_reasons(inner_model(model))
        if reasons:
            raise NotSupportedError(self.name, reasons)
        self.policy = model  # as given (maybe wrapped); self.model: what the decode loop runs
        self.model, self.draft, self.verifier = inner_model(model), draft, verifier
        self.config = config or SpeculativeConfig()
        self.tree_verifier, self.sampled_tree_verifier = tree_verifier, sampled_tree_verifier
        self.tree_acceptance = TreeAcceptance(decay=self.config.acceptance_decay)
        self.tree_cost = TreeCost()
        self._tree_reasons = self.tree_reasons()
        self.acceptance = AcceptanceEstimate(self.config.acceptance_prior, decay=self.config.acceptance_decay)
        self.cost: CostModel | None = None
        #: why the last rollout's decode forwards ran the model's own forward (empty: the lean one)
        self.lean_forward_reasons: list[str] = []
        self.refusals = PathRefusals()  # what the last rollout could not run, and why (logged, counted)
        self.last_trace = DecodeTrace()  # per decode step of the last rollout: rows, k, tokens, why
        #: per calibrated batch size: decisions so far, the last probe, the gap to the next one (a
        #: tail that drafts at 1 row must not reset the back-off of the 64-row steps, where a k=1
        #: probe per rollout is a measurable cost with the n-gram draft)
        self._steps: dict[int, int] = {}
        self._last_probe: dict[int, int] = {}
        self._probe_gap: dict[int, int] = {}
        #: decisions between chains and trees so far, and the last one that ran each shape
        self._shape_steps = 0
        self._last_shape = {"chain": 0, "tree": 0}
        #: steps between probes of a shape: 2, 4, 8, ... up to ``probe_every`` (measured early)
        self._shape_gap = {"chain": 2, "tree": 2}

    def not_supported_reasons(self, params: SamplingParams) -> list[str]:
        reasons = check_model(self.model) or sharded_reasons(self.policy) or recurrent_reasons(self.model)
        if reasons:
            return reasons
        window = sliding_window(self.model)
        why = None if window is None else window_reason(window, 1, params.max_new_tokens)
        return reasons + ([why] if why else []) + self.draft.not_supported_reasons(self.model, params)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        if policy is not self.policy:
            self.policy, self.model = policy, inner_model(policy)
            self.cost = None  # a different module may cost differently
        self.draft.bind_policy(self.model)

    def calibrate(
        self, max_rows: int, context_len: int | Callable[[int], int], params: SamplingParams,
        prompt_len: int = 0,
    ) -> CostModel:  # fmt: skip
        """Time the policy's verification (``A x T`` grid) and the draft on this machine, on the decode
        loop's own forwards (:func:`.calibration.calibrate`)."""
        cfg = self.config
        biggest = max(cfg.max_draft_tokens, cfg.max_tree_nodes if not self._tree_reasons else 0)
        attention = (cfg.decode_shared_prompt, not self.decode_attention_reasons(params))
        self.cost = calibrate(
            self.model, self.draft, params, max_rows, biggest + 1, context_len, prompt_len,
            cfg.calibrate_repeats, attention, cfg.max_draft_tokens, cfg.lean_forward,
        )  # fmt: skip
        return self.cost

    def choose_k(self, active: int, remaining: int, step: int) -> int:
        """Draft length for this step (at most ``remaining - 1``: the step always emits one more)."""
        cap = min(self.config.max_draft_tokens, remaining - 1)
        if cap <= 0:
            return 0
        if self.config.draft_tokens is not None:
            return min(self.config.draft_tokens, cap)
        assert self.cost is not None
        k = self.cost.choose(active, self.chain_rates(active, cap), cap)
        b = self.cost.bucket(active)
        steps = self._steps[b] = self._steps.get(b, 0) + 1
        gap = self._probe_gap.get(b, self.config.probe_every)
        last = self.cost.last_ratio(active, True)
        if last is not None and last < 0.8 * self.cost.scale_at(active, True):
            # the last speculative step here ran well below its price (a stale estimate): measure
            # again soon rather than after a doubled gap, so two probes can correct it
            gap = self.config.probe_every
        if k > 0:
            self._probe_gap[b] = self.config.probe_every
        elif steps - self._last_probe.get(b, 0) >= gap:
            # probe so a better draft (or a disturbed calibration) is noticed, backing off
            # exponentially while probes keep failing, so "off" costs next to nothing
            k, self._last_probe[b] = 1, steps
            self._probe_gap[b] = min(2 * gap, 1024)
        return k

    def chain_rates(self, active: int, max_k: int) -> list[float]:
        """Measured per-depth chain acceptance at ``active`` rows' batch-size bucket (the chain
        lengths worth pricing: at most one position past the measured ones)."""
        bucket = None if self.cost is None else self.cost.bucket(active)
        return self.acceptance.depth_rates(bucket, max_k)

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        # inference_mode as the reference sampler (outputs cloned out of it for autograd); the model's own
        # attention under a training kernel an adapter left selected (TRL generates inside its training step)
        with torch.inference_mode(), collector_paused(), own_attention_selected(self.model):
            parts = self._decode(prompts, params, generator)
        parts = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in parts)
        with torch.no_grad():
            return self._finish(*parts)

    def _decode(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[Any, ...]:
        reasons = self.not_supported_reasons(params)
        if prompts.vision is not None:
            reasons += image_prompt_reasons(self)
        if reasons:
            raise NotSupportedError(self.name, reasons)
        model, draft = self.model, self.draft
        device = next(model.parameters()).device
        expanded = tuple(t.to(device) for t in expand_prompts(prompts, params.group_size))
        ids, pmask, group = expanded
        n, width = ids.shape
        window = sliding_window(model)
        why = None if window is None else window_reason(window, width, params.max_new_tokens)
        if why:
            raise NotSupportedError(self.name, [why])
        if self.config.draft_tokens is None and (self.cost is None or max(self.cost.batch_sizes) < n):
            ctx = calibration_context(n, width, params.max_new_tokens, window, self.config.max_draft_tokens)
            self.calibrate(n, ctx, params, width)
        draft.reset(ids, pmask, group)
        st = DecodeState.prefill(model, prompts, params, expanded, draft.needs_hidden_states, generator)  # type: ignore[arg-type]
        st.window = window
        steps = (keys.VERIFY_STEPS, keys.PLAIN_STEPS, keys.TREE_STEPS, keys.SAMPLED_TREE_STEPS)
        stats = dict.fromkeys((*steps, "drafted", "accepted", "emitted_spec", "row_verifies"), 0.0)
        stats[keys.KV_IN_PLACE_LAYERS] = float(st.room_layers)
        self.last_trace = DecodeTrace()
        why_not = self.decode_attention_reasons(params)
        with shared_prompt_decoding(st, why_not, self.config.decode_shared_prompt):
            # inside the kernel's block: the lean forward calls the attention selected there
            st.lean, off = lean_forward_for(model, self.config.lean_forward)
            cfg = self.config
            self.refusals.record(stats, off, cfg.lean_forward, why_not, cfg.decode_shared_prompt)
            self.lean_forward_reasons = off
            self._loop(st, params, generator, stats)
        stats[keys.LEAN_FORWARD_CALLS] = float(st.forwards["lean"])
        stats[keys.MODEL_FORWARD_CALLS] = float(st.forwards["model"])
        calls = st.layout.calls if st.layout is not None else {}
        for path, key in keys.DECODE_ATTENTION_CALLS.items():
            stats[key] = float(calls.get(path, 0))
        comp, logps, emitted = st.outputs()
        return ids, pmask, group, comp, logps, emitted, params, prompts.num_prompts, stats

    def _loop(
        self, st: DecodeState, params: SamplingParams, generator: torch.Generator | None, stats: dict[str, float],
    ) -> None:  # fmt: skip
        """Decode until every row finished: per step a plan (plain, chain or tree) for the rows left."""
        trace, step = self.last_trace, 0
        while st.drop_finished():
            a = st.act.numel()
            t_step = time.perf_counter()
            plan = self.choose_plan(a, st.remaining(), step, st.window_room())
            step += 1
            if plan == 0:  # plain decoding step, as lean as the reference sampler's
                st.plain_step(generator)
                stats[keys.PLAIN_STEPS] += 1
                if self.cost is not None:
                    self.cost.observe_step(a, 0, time.perf_counter() - t_step, 0.0)
                trace.record(a, 0, 1.0, self.acceptance.rate, self.cost)
                continue
            self._speculative_step(st, plan, params, generator, stats, trace, t_step)

    def decode_attention_reasons(self, params: SamplingParams) -> list[str]:
        """Why the decode loop runs the policy's own attention everywhere (empty: the shared-prompt
        decode attention is selected and the cost rule picks it per forward)."""
        if self.config.decode_shared_prompt == "off":
            return ["config: decode_shared_prompt='off'"]
        return decode_attention_reasons(self.model, params.group_size)

    def tree_reasons(self) -> list[str]:
        """Why this sampler drafts chains only (empty: trees are candidates)."""
        reasons = []
        if not isinstance(self.draft, TreeDraftModel):
            reasons.append(f"draft: {type(self.draft).__name__} has no propose_tree")
        attn = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if attn not in ("eager", "sdpa"):
            reasons.append(f"model: attention {attn!r} takes no tree mask (eager and sdpa do)")
        if self.config.max_tree_nodes == 0 and self.config.tree_nodes is None:
            reasons.append("config: max_tree_nodes=0")
        return reasons

    def tree_budgets(self) -> list[TreeBudget]:
        """The tree sizes the cost model weighs (powers of two from 4 up to ``max_tree_nodes``)."""
        sizes = [n for n in (4, 8, 16, 32, 64, 128) if n <= self.config.max_tree_nodes]
        return [self.config.tree_budget(n) for n in sizes]

    def choose_plan(self, active: int, remaining: int, step: int, room: int) -> int | TreeBudget:
        """This step's draft: 0 (plain), a chain length ``k``, or a tree budget. Trees only when
        the draft and the attention kernel support them (:meth:`tree_reasons`)."""
        trees_ok = remaining > 1 and not self._tree_reasons
        if self.config.tree_nodes is not None and trees_ok:
            nodes = min(self.config.tree_nodes, room)
            if nodes >= 1:
                return self.config.tree_budget(nodes)
        k = min(self.choose_k(active, remaining, step), room)
        if not trees_ok or self.cost is None or self.config.draft_tokens is not None:
            return k
        budgets = [b for b in self.tree_budgets() if b.nodes <= room]
        plan = choose_plan(
            self.cost, self.tree_cost, self.tree_acceptance, active, self.acceptance.rate, k, budgets,
            chain_rates=self.chain_rates(active, k),
        )  # fmt: skip
        return self._probe_other_shape(plan, k, active, budgets)

    def _probe_other_shape(
        self, plan: int | TreeBudget, k: int, active: int, budgets: list[TreeBudget]
    ) -> int | TreeBudget:
        """Chains and trees are judged on their own measured acceptance, which only a step of that
        shape updates: while one shape wins, the other is tried after 2, 4, 8, ... and then every
        ``probe_every`` steps (a chain when the cost model would draft one at all; a tree when
        chains win and its predicted rate is at least 0.7 of theirs, so probes are a small share of
        the steps), so a stale estimate -- e.g. a chain acceptance never measured because trees ran
        from the start -- cannot lock in the worse shape."""
        assert self.cost is not None
        self._shape_steps += 1
        gap, last = self._shape_gap, self._last_shape
        probe: int | TreeBudget | None = None
        if isinstance(plan, TreeBudget):
            if k > 0 and self._shape_steps - last["chain"] >= gap["chain"]:
                probe, kind = k, "chain"
        elif plan > 0 and budgets and self._shape_steps - last["tree"] >= gap["tree"]:
            chain = self.cost.rate(active, plan, self.chain_rates(active, plan))
            tree, rate = best_tree(
                self.cost, self.tree_cost, self.tree_acceptance, active, self.acceptance.rate, budgets
            )
            if tree is not None and rate >= 0.7 * chain:
                probe, kind = tree, "tree"
        if probe is None:
            return plan
        gap[kind] = min(2 * gap[kind], self.config.probe_every)
        return probe

    def _speculative_step(
        self, st: DecodeState, plan: int | TreeBudget, params: SamplingParams, generator: torch.Generator | None,
        stats: dict[str, float], trace: DecodeTrace, t_step: float,
    ) -> None:  # fmt: skip
        a, ctx = st.act.numel(), st.draft_context()
        t0 = time.perf_counter()
        if isinstance(plan, TreeBudget):
            prop = self.draft.propose_tree(ctx, plan, params, generator)  # type: ignore[attr-defined]
        else:
            prop = self.draft.propose(ctx, plan, params, generator)
        t_draft = time.perf_counter() - t0
        k = prop.tokens.shape[1]
        predicted = tokens = None
        if isinstance(plan, TreeBudget):
            parents = prop.chain_parents()
            self._last_shape["tree"] = self._shape_steps
            verifier = self.tree_verifier
            if prop.sampled:  # children drawn from the draft: recursive rejection sampling
                verifier = partial(self.sampled_tree_verifier, probs=prop.probs)
                stats[keys.SAMPLED_TREE_STEPS] += 1
            n_acc, take, (depth, width) = st.verify_tree(prop.tokens, parents, verifier, generator)
            stats[keys.TREE_STEPS] += 1
            self.tree_acceptance.update(k, plan.depth, n_acc)
            if self.cost is not None:
                self.tree_cost.observe(self.cost.bucket(a), k, t_draft)
                predicted = tree_step_time(self.cost, self.tree_cost, a, plan) / self.cost.scale_at(a, True)
                tokens = k + 1
        else:
            self._last_shape["chain"] = self._shape_steps
            if self.cost is not None:
                self.cost.observe_draft(a, k, t_draft)
            n_acc, take = st.verify_chain(prop.tokens, prop.probs, self.verifier, generator)
            self.acceptance.update(n_acc, k, None if self.cost is None else self.cost.bucket(a))
            depth, width = k, 1
        trace.record(
            a, k, float(take.float().mean()), self.acceptance.rate, self.cost, depth=depth, width=width
        )
        stats[keys.VERIFY_STEPS] += 1
        stats["drafted"] += k * a
        stats["accepted"] += float(n_acc.sum())
        stats["emitted_spec"] += float(take.sum())
        stats["row_verifies"] += a
        st.release(k - n_acc, self.config.compact_waste)
        if self.cost is not None:  # the whole step, cache housekeeping included
            self.cost.observe_step(a, k, time.perf_counter() - t_step, t_draft, predicted, tokens)

    def _finish(
        self, ids: torch.Tensor, pmask: torch.Tensor, group: torch.Tensor, comp: torch.Tensor, logps: torch.Tensor,
        emitted: torch.Tensor, params: SamplingParams, num_prompts: int, stats: dict[str, float],
    ) -> Rollout:  # fmt: skip
        t = int(emitted.max())
        comp, logps = comp[:, :t], logps[:, :t]
        cmask = completion_mask_from_eos(comp, params.eos_token_ids)
        cmask = cmask * (torch.arange(t, device=comp.device)[None, :] < emitted[:, None]).long()
        rollout = padded_rollout(ids, pmask, group, comp, cmask, logps, params, num_prompts)
        out_stats = keys.speculative_stats(stats, self.acceptance.rate)
        self.draft.observe(rollout.completion_ids, rollout.completion_mask, group)
        if self.config.train_draft and self.draft.learnable:
            t0 = time.perf_counter()
            metrics = self.draft.update(self.draft_training_batch(rollout))
            out_stats[keys.DRAFT_UPDATE_S] = time.perf_counter() - t0
            out_stats.update({f"draft_{k}": float(v) for k, v in metrics.items()})
        rollout.stats.update(out_stats)
        return rollout

    @torch.no_grad()
    def draft_training_batch(self, rollout: Rollout) -> DraftTrainingBatch:
        """One plain forward of the policy over prompt + completion (:class:`~..protocol.TrainsDraft`)."""
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        attn = torch.cat([rollout.prompt_mask.long(), rollout.completion_mask.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True)
        p = rollout.prompt_ids.shape[1]
        loss_mask = torch.zeros_like(attn)
        loss_mask[:, p - 1 : p - 1 + rollout.completion_ids.shape[1]] = rollout.completion_mask.long()
        return DraftTrainingBatch(ids, loss_mask, out.hidden_states[-1], out.logits, attention_mask=attn)
