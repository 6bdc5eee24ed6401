"""Requests of one prompt, one completion each, regrouped into a sampler's prompt groups (verl's
agent loop and OpenRLHF's agent executor run one request per completion)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["identical_prompt_groups"]


def identical_prompt_groups(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], int, list[int]]:
    """``(unique prompts, group_size, rows)``: verl and OpenRLHF hand an agent loop one completion per
    request, so a prompt's ``G`` completions arrive as ``G`` identical requests. When every distinct
    prompt appears the same ``G`` times: the distinct prompts (first-seen order), ``G``, and for each
    row of the sampler's rollout (prompt-major) the request it answers -- so the sampler sees shared
    prompts (its decode attention reads each once, its drafts look up siblings). Otherwise the
    requests as they are, ``group_size=1`` and the identity."""
    uniq: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        uniq.setdefault(tuple(p), []).append(i)
    counts = {len(v) for v in uniq.values()}
    if len(counts) == 1 and len(prompts) > len(uniq):
        return [list(k) for k in uniq], counts.pop(), [i for v in uniq.values() for i in v]
    return [list(p) for p in prompts], 1, list(range(len(prompts)))
