"""The speculative sampler's settings (:class:`SpeculativeConfig`), validated, with FastGRPO's split
of a tree's node budget into depth and width."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ...draft.protocol import TreeBudget


class SpeculativeConfig(BaseModel):
    """``draft_tokens`` fixes ``k`` (no cost model: for tests and ablations); otherwise ``k`` is
    chosen per step in ``0 .. max_draft_tokens``. ``train_draft``: after each rollout, call the
    draft's ``update`` (online learning) when it is learnable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # 6: higher ceilings did not pay (docs/results.md; the log's "Chains priced by measured per-depth acceptance")
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
    decode_shared_prompt: Literal["auto", "always", "off"] = Field(
        "auto",
        description="decode attention reads each group's prompt K/V once where the model allows it "
        "(sampler/speculative/decode_attention.py): 'auto' where its cost rule says it pays, 'always' in every "
        "decode forward (tests, ablations), 'off': the policy's own attention",
    )
    lean_forward: Literal["auto", "on", "off"] = Field(
        "auto",
        description="decode forwards call the policy's weights directly, without transformers' "
        "per-forward overhead (sampler/speculative/lean_forward.py; Llama-family models): 'auto' where it "
        "serves the model, 'on' to refuse a model it cannot serve, 'off': the model's own forward",
    )
    tree_nodes: int | None = Field(
        None, ge=1, le=128, description="fix a draft tree of this many nodes per row (tests, ablations)"
    )
    # 0: trees have not beaten chains on CPU in any measurement (docs/speculative.md, "Trees are off
    # by default"; docs/results.md, Sampler). Opt in with e.g. 32.
    max_tree_nodes: int = Field(
        0, ge=0, le=128, description="largest tree the cost model may pick per row (0: chains only)"
    )
    tree_alpha: float = Field(0.75, gt=0.0, description="FastGRPO's depth constant: L = log2(N / alpha)")
    tree_min_depth: int = Field(3, ge=1)
    tree_max_depth: int = Field(6, ge=1)
    tree_max_width: int = Field(8, ge=1)

    def tree_budget(self, nodes: int) -> TreeBudget:
        """FastGRPO's split of ``N`` nodes: depth ``clamp(floor(log2(N / alpha)), L_min, L_max)``
        (at most ``N``), width ``min(N - 1, K_max)`` (at least 1)."""
        depth = int(math.floor(math.log2(max(nodes / self.tree_alpha, 1.0))))
        depth = min(max(depth, self.tree_min_depth), self.tree_max_depth, nodes)
        return TreeBudget(nodes, depth, max(1, min(nodes - 1, self.tree_max_width)))
