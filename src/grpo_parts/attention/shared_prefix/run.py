"""Run a :class:`.plan.Plan`: each model call's layout built, one forward each, un-grouped, merged.

Nothing here decides anything: the plan says which rows each call holds, in which layout, with
which kernel, and how many empty calls keep the ranks in step. Rows of different groups never
attend to each other, so running the groups as several calls and un-permuting the rows gives the
reference's log-probs and gradients; every call's largest position id is the whole batch's, as in
the reference's one forward (:mod:`.layout`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from ...core import token_logprobs
from ..protocol import LogprobBatch, LogprobOutput
from ..reference import entropy_from_logits
from .chunking import empty_call_batch
from .grouped_forward import grouped_forward
from .guard import refusing
from .layout import build_grouped_inputs, ungroup_logits
from .padding_free import build_padding_free_inputs
from .plan import Plan


@dataclass
class PlanRun:
    """One run of ``plan`` on ``model``; :meth:`__call__` returns the output. ``attention_calls``
    counts the padding-free attention calls per path, ``masked_why`` says why a masked kernel ran."""

    model: torch.nn.Module
    plan: Plan
    temperature: float
    compute_entropy: bool
    attention_calls: Counter[str] = field(default_factory=Counter)
    masked_why: list[str] = field(default_factory=list)

    def __call__(self, batch: LogprobBatch) -> LogprobOutput:
        plan = self.plan
        if plan.group_index is not batch.group_index:  # sub-groups (packed=True)
            batch = replace(batch, group_index=plan.group_index)
        if len(plan.calls) == 1 and not plan.empty_calls:
            return self._call(batch, plan.layout, self.compute_entropy, None)
        top = plan.facts.max_span - 1
        outs = [self._call(batch.select(c), plan.layout, self.compute_entropy, top) for c in plan.calls]
        # empty calls (other ranks run more): in the graph times zero, so their backward runs too
        empty = [self._call(empty_call_batch(batch), "grid", False, top) for _ in range(plan.empty_calls)]
        zero = sum(o.logprobs.sum() * 0.0 for o in empty)
        with refusing("un-grouping the calls", self.model):
            back = torch.argsort(torch.cat(plan.calls))
            logps = torch.cat([o.logprobs for o in outs])[back] + zero
            if not self.compute_entropy:
                return LogprobOutput(logps, None)
            ents = torch.cat([o.entropies for o in outs if o.entropies is not None])[back]
            return LogprobOutput(logps, ents + zero)

    def _call(
        self, batch: LogprobBatch, layout: str, entropy: bool, max_position: int | None
    ) -> LogprobOutput:
        """One model call on ``batch`` in ``layout``; ``max_position``: the whole batch's largest
        position id (None: this batch's)."""
        build = build_padding_free_inputs if layout == "padding_free" else build_grouped_inputs
        with refusing("building the layout", self.model):
            grouped = build(batch, self.plan.settings.layout_settings, max_position)
        kept = grouped_forward(self.model, grouped)  # raises NotSupportedError for what the model breaks
        if layout == "padding_free":
            masks = grouped.layout.masks
            self.attention_calls.update(masks.calls)
            self.masked_why += [w for w in masks.why if w not in self.masked_why]
        with refusing("un-grouping the logits", self.model):
            return _output(batch, ungroup_logits(kept, grouped), self.temperature, entropy)


def _output(batch: LogprobBatch, logits: torch.Tensor, temperature: float, entropy: bool) -> LogprobOutput:
    """One call's log-probs (and entropies) from its un-grouped ``logits: [N, S, V]``, ``S`` its
    longest completion; zero on padding."""
    n, t = batch.completion_ids.shape
    s = logits.shape[1]
    cm = batch.completion_mask.bool()
    lp = token_logprobs(logits, batch.completion_ids[:, :s], temperature)
    logps = lp.new_zeros(n, t)
    logps[:, :s] = lp
    logps = logps.masked_fill(~cm, 0.0)
    if not entropy:
        return LogprobOutput(logps, None)
    ent = entropy_from_logits(logits.float() if logits.dtype != torch.float64 else logits, temperature)
    ents = ent.new_zeros(n, t)
    ents[:, :s] = ent
    return LogprobOutput(logps, ents.masked_fill(~cm, 0.0))
