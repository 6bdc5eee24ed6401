"""What the speculative sampler did at every decode step of its last rollout, and why
(docs/speculative.md, "What it did, per decode step", names the fields)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class DecodeTrace:
    active: list[int] = field(default_factory=list)
    k: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    break_even: list[float | None] = field(default_factory=list)
    t_plain_ms: list[float | None] = field(default_factory=list)
    t_spec_ms: list[float | None] = field(default_factory=list)
    #: tree shape per step (a chain of k: depth k, width 1; plain: 0, 0); ``k`` is the node count
    depth: list[int] = field(default_factory=list)
    width: list[int] = field(default_factory=list)

    def record(
        self, active: int, k: int, tokens: float, acceptance: float, cost: Any,
        depth: int | None = None, width: int | None = None,
    ) -> None:  # fmt: skip
        self.active.append(int(active))
        self.k.append(int(k))
        self.depth.append(int(k if depth is None else depth))
        self.width.append(int((1 if k else 0) if width is None else width))
        self.tokens.append(round(float(tokens), 4))
        self.acceptance.append(round(float(acceptance), 4))
        plain = cost is not None and k == 0  # the cost model's reasons are kept for plain steps only (cheap)
        self.break_even.append(round(float(cost.break_even_acceptance(active)), 4) if plain else None)
        self.t_plain_ms.append(round(1e3 * float(cost.step_time(active, 0)), 4) if plain else None)
        self.t_spec_ms.append(round(1e3 * float(cost.step_time(active, 1)), 4) if plain else None)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def off_reason(trace: dict[str, Any]) -> str | None:
    """One sentence on why speculation was off where it was, with the cost model's numbers (None
    when it was on at every step)."""
    off = [i for i, k in enumerate(trace.get("k", [])) if k == 0]
    if not off:
        return None
    n = len(trace["k"])
    # the most common batch size among the plain steps, as the representative case
    sizes = [trace["active"][i] for i in off]
    a = max(set(sizes), key=sizes.count)
    i = next(i for i in off if trace["active"][i] == a)
    be, acc = trace["break_even"][i], trace["acceptance"][i]
    tp, ts = trace["t_plain_ms"][i], trace["t_spec_ms"][i]
    head = f"speculation was off in {len(off)} of {n} decode steps (batch sizes {min(sizes)}-{max(sizes)})"
    if be is None:
        return f"{head}: the draft length was fixed by the config (no cost model)"
    if be >= 1.0:
        why = (
            f"at {a} active rows a plain step is predicted at {tp:.2f} ms and a step drafting one token at "
            f"{ts:.2f} ms, so drafting cannot pay even with every draft token accepted "
            f"(break-even acceptance {be:.2f} >= 1)"
        )
    else:
        why = (
            f"at {a} active rows the acceptance estimate {acc:.2f} is below the break-even {be:.2f} "
            f"(plain step {tp:.2f} ms, one-token draft step {ts:.2f} ms)"
        )
    return f"{head}; e.g. {why}"
