"""Requests of one prompt, one completion each, regrouped into a sampler's prompt groups.

verl runs an agent loop per completion and OpenRLHF an agent executor call per completion: a
prompt's ``G`` completions arrive as ``G`` requests with identical token ids. Handed to a grpo_parts
sampler as ``G`` prompts of ``group_size=1`` they share nothing (the speculative sampler's decode
attention reads each group's prompt once, its drafts look up sibling completions); regrouped, the
sampler sees ``len(unique)`` prompts of ``group_size=G``.

Framework-free (no verl/OpenRLHF import), so every adapter can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["identical_prompt_groups"]


def identical_prompt_groups(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], int, list[int]]:
    """``(unique prompts, group_size, rows)``: when every distinct prompt appears the same number
    ``G`` of times, the distinct prompts (first-seen order), ``G``, and for each row of the sampler's
    rollout (prompt-major, ``G`` rows per prompt) the request it answers; otherwise the requests as
    they are, ``group_size=1`` and the identity (a sampler's groups must all have ``G`` rows)."""
    uniq: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        uniq.setdefault(tuple(p), []).append(i)
    counts = {len(v) for v in uniq.values()}
    if len(counts) == 1 and len(prompts) > len(uniq):
        return [list(k) for k in uniq], counts.pop(), [i for v in uniq.values() for i in v]
    return [list(p) for p in prompts], 1, list(range(len(prompts)))
