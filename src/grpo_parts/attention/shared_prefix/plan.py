"""One plan per shared-prefix call: every decision about a batch, made once, before any forward.

:func:`make_plan` reads the group facts in one host sync and returns a frozen :class:`Plan`: kernel,
layout (:mod:`.layout_choice`), the model calls (:mod:`.chunking`) with the empty calls that keep
ranks in step (:meth:`Plan.agreed`), token counts and :meth:`Plan.info`; the run decides nothing.
``packed=True`` (verl's remove-padding, OpenRLHF's ``packing_samples``) guarantees ``Plan.tokens``
never exceeds the packed tokens (docs/attention.md, "Sub-groups for long tails inside a group").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...distributed import agree_on_calls, ranks_of
from ..protocol import PLAN_CHUNKS, PLAN_GRID_SLOTS, LogprobBatch
from .chunking import chunk_plan, grid_calls, split_long_tails
from .facts import GroupFacts
from .layout import LayoutSettings
from .layout_choice import auto_costs, choose_layout


@dataclass(frozen=True)
class PlanSettings:
    """The backend's settings a plan reads: the kernel's choice (``kernel_why``), the requested ``layout``,
    grid splitting (``max_chunks``, ``chunk_overhead_tokens``, :mod:`.chunking`), the model's text ``config``
    (score weights) and ``build``, what building either layout reads (the kernel, the model's context, the
    grid ``sdpa`` kernel's ``tile_elems`` / ``suffix_flash_min``, the padding-free ``varlen`` kernels)."""

    kernel_why: str
    layout: str
    max_chunks: int
    chunk_overhead_tokens: int
    config: Any
    build: LayoutSettings


@dataclass(frozen=True)
class Plan:
    """How one call runs. ``calls``: the row indices ``[n_i]`` of each model call, on the batch's
    device (one call for a padding-free layout); ``empty_calls``: the calls run only to match other
    ranks; ``group_index: [N]`` the groups the layout shares a prefix over (sub-groups of the
    batch's groups with ``packed=True``), ``facts`` theirs. Token counts: ``grid_slots`` (the grids'
    slots), ``single_grid_slots`` (one grid), ``repeated_slots`` (``N x (P + S)``, the reference),
    ``padding_free_tokens`` and ``packed_tokens``."""

    settings: PlanSettings
    layout: str
    layout_why: str
    calls: tuple[torch.Tensor, ...]
    empty_calls: int
    group_index: torch.Tensor
    facts: GroupFacts
    grid_slots: float
    single_grid_slots: float
    repeated_slots: float
    padding_free_tokens: int
    packed_tokens: int

    @property
    def kernel(self) -> str:
        return self.settings.build.kernel

    @property
    def model_calls(self) -> int:
        return len(self.calls) + self.empty_calls

    @property
    def tokens(self) -> float:
        """Tokens the model runs on for this plan's layout (without empty calls)."""
        return float(self.padding_free_tokens) if self.layout == "padding_free" else self.grid_slots

    def agreed(self, calls: int) -> Plan:
        """This plan making ``calls`` model calls (what the ranks agreed on, at least :attr:`model_calls`
        without empty calls): a grid re-plans with up to that many grids at no overhead (the calls run
        anyway), and the rest are empty calls; a padding-free call is not split."""
        if calls <= len(self.calls) or self.layout != "grid":
            return replace(self, empty_calls=max(0, calls - len(self.calls)))
        chunks, info = chunk_plan(self.facts, 0, calls)
        device = self.group_index.device
        return replace(
            self,
            calls=tuple(c.to(device) for c in chunks),
            empty_calls=calls - len(chunks),
            grid_slots=info[PLAN_GRID_SLOTS],
        )

    def info(self) -> dict[str, Any]:
        """What the backend's ``last_plan`` says about this call (keys ``PLAN_*`` and more)."""
        s = self.settings
        return {
            "groups": int(self.facts.rows.numel()),
            PLAN_CHUNKS: len(self.calls),
            PLAN_GRID_SLOTS: self.grid_slots,
            "single_grid_slots": self.single_grid_slots,
            "repeated_slots": self.repeated_slots,
            "model_calls": self.model_calls,
            "empty_calls": self.empty_calls,
            "kernel": s.build.kernel,
            "kernel_choice": s.kernel_why,
            "layout": self.layout,
            "layout_choice": self.layout_why,
            "padding_free_tokens": self.padding_free_tokens,
            "packed_tokens": self.packed_tokens,
        }


def make_plan(
    batch: LogprobBatch,
    settings: PlanSettings,
    *,
    packed: bool = False,
    agree: bool = True,
    rank_group: Any = None,
) -> Plan:
    """The plan of ``batch`` (see the module docstring). ``agree``: with several processes in
    ``rank_group`` (None: all), one all-reduce makes the model calls equal on every rank."""
    device = batch.group_index.device
    facts = GroupFacts.of(batch)  # the only host sync
    grid_facts, group_index = facts, batch.group_index
    if packed:
        split = split_long_tails(facts.row_group, facts.prompt_row, facts.completion)
        grid_facts, group_index = facts.from_rows(split, facts.prompt_row, facts.completion), split.to(device)
    chunks, info = grid_calls(grid_facts, settings.chunk_overhead_tokens, settings.max_chunks, packed)
    grid, free, weight = auto_costs(
        grid_facts, chunks, info[PLAN_GRID_SLOTS], facts, settings.config, settings.build
    )
    layout, why = choose_layout(settings.layout, grid, free, weight)
    if layout == "padding_free":  # one call over the batch's own groups
        chunks, grid_facts, group_index = [torch.arange(facts.row_group.numel())], facts, batch.group_index
    plan = Plan(
        settings,
        layout,
        why,
        tuple(c.to(device) for c in chunks),
        0,
        group_index,
        grid_facts,
        info[PLAN_GRID_SLOTS],
        info["single_grid_slots"],
        info["repeated_slots"],
        facts.padding_free_tokens,
        facts.packed_tokens,
    )
    if agree and ranks_of(rank_group) > 1:
        plan = plan.agreed(agree_on_calls(plan.model_calls, rank_group, device))
    return plan
