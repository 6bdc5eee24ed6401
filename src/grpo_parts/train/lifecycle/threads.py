"""How many torch CPU threads a ``--model`` run on the CPU uses: 1 or every core, whichever a short
calibration estimates faster, since torch's default (one per core) is often the slowest for GRPO's
tiny decode forwards (docs/training.md, ``threads``). It touches no RNG and leaves no gradients."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger("grpo_parts.train")
#: the forward+backward probe: rows x tokens (its cost is scaled to a step's training tokens)
PROBE_ROWS, PROBE_TOKENS = 4, 32
REPEATS = 3


def available_cores() -> int:
    """The cores this process may run on (torch's default thread count is about this)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _best_of(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def calibrate_threads(
    policy: torch.nn.Module, rows: int, max_new_tokens: int, candidates: list[int] | None = None
) -> tuple[int, str]:
    """``(threads, note)``: the candidate with the smallest estimated step time; ``note`` says why."""
    cands = candidates or sorted({1, available_cores()})
    if len(cands) == 1:
        torch.set_num_threads(cands[0])
        return cands[0], f"threads: {cands[0]} (the only core this process may use)"
    vocab = int(policy.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    device = next(policy.parameters()).device
    decode_ids = (torch.arange(rows, device=device) % vocab)[:, None]
    train_ids = (torch.arange(PROBE_ROWS * PROBE_TOKENS, device=device) % vocab).view(PROBE_ROWS, -1)
    was_training = policy.training
    policy.eval()  # no dropout: no RNG drawn

    def decode() -> None:
        with torch.no_grad():
            policy(decode_ids)

    def train() -> None:
        policy(train_ids).logits.float().mean().backward()

    times: dict[int, list[tuple[float, float]]] = {c: [] for c in cands}
    try:
        for rep in range(REPEATS + 1):  # the first round warms up (allocations, kernels), not counted
            for c in cands:
                torch.set_num_threads(c)
                d, f = _best_of(decode), _best_of(train)
                if rep:
                    times[c].append((d, f))
    finally:
        policy.zero_grad(set_to_none=True)
        policy.train(was_training)
    scale = rows * max_new_tokens / (PROBE_ROWS * PROBE_TOKENS)
    est = {
        c: max_new_tokens * min(d for d, _ in ts) + scale * min(f for _, f in ts) for c, ts in times.items()
    }
    best = min(est, key=lambda c: est[c])
    torch.set_num_threads(best)
    others = ", ".join(f"{est[c]:.2f} s with {c}" for c in cands if c != best)
    return best, (
        f"threads: {best} (calibrated: estimated step {est[best]:.2f} s with {best} thread"
        f"{'s' if best > 1 else ''} vs {others}; set threads to fix it)"
    )
