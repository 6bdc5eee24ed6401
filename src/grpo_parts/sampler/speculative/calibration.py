"""Start-up timing of the speculative sampler's costs on the running machine (FastGRPO's budget
``C``, measured) into a :class:`~.cost_model.CostModel`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...compat import cache_kwarg, crop_cache, output_cache, repeat_cache_rows
from ...decoding import CACHE_ROOM, SamplingParams, reserve_cache_room
from ...draft.protocol import DraftContext, DraftModel
from .cost_model import CostModel, batch_grid, token_grid
from .decode_attention import LAYOUT_KWARG, DecodeLayout, decode_kernel
from .lean_forward import LeanForward, lean_forward_for


def calibrate(
    model: torch.nn.Module, draft: DraftModel, params: SamplingParams, max_rows: int, max_tokens: int,
    context_len: int | Callable[[int], int], prompt_len: int, repeats: int, attention: tuple[str, bool],
    max_draft: int, lean_mode: str = "auto",
) -> CostModel:  # fmt: skip
    """The cost table for up to ``max_rows`` rows and ``max_tokens`` tokens per row (the longest chain's or
    tree's verification), timed on the decode loop's forwards: rows in groups of ``params.group_size`` sharing
    the first ``prompt_len`` cache columns, under the decode attention kernel of
    ``attention = (mode, shared_ok)`` (``SpeculativeConfig.decode_shared_prompt`` and whether the
    shared-prompt path may run). ``context_len``: cache columns, or per batch size
    (:func:`calibration_context`), through the lean forward where the loop will run it (``lean_mode``:
    ``SpeculativeConfig.lean_forward``). The draft is timed proposing 1 and ``max_draft`` tokens."""
    mode, shared_ok = attention
    sizes, toks = batch_grid(max_rows), token_grid(max_tokens)
    calls = {"shared_prefix": 0, "plain": 0, "plain_gqa": 0}
    device = next(model.parameters()).device

    def layout(a: int) -> DecodeLayout:  # the rollout's: rows in groups of G, on the model's device
        group = torch.arange(a, device=device) // params.group_size
        return DecodeLayout.build(group, prompt_len, calls, always=mode == "always", shared_ok=shared_ok)

    with decode_kernel(model, mode) as on:
        lean, _ = lean_forward_for(model, lean_mode)
        table = calibrate_policy(model, sizes, toks, context_len, repeats, layout if on else None, lean)
    cost = CostModel(sizes, toks, table, calibration_calls=calls)
    dctx = context_len(1) if callable(context_len) else context_len
    calibrate_draft(draft, model, cost, params, dctx, max_draft, repeats)
    return cost


#: a start-up forward at least this long is timed once (repeats guard only short forwards against
#: noise; online step times rescale every prediction anyway)
LONG_FORWARD_S = 0.02


def calibration_context(
    rows: int, width: int, max_new_tokens: int, window: int | None, max_draft: int
) -> Callable[[int], int]:
    """Cache length at which ``A`` of ``rows`` rows are timed: ``width + max_new_tokens * (1 - A /
    (rows + 1))``, the prompt alone for a full batch and nearly all of ``max_new_tokens`` at one row
    of many (a lone row, ``rows == 1``, is timed half-way). Rows finish as the rollout goes on, so
    few active rows go with long caches (the main job's decode forwards: the log's "Calibration on
    the decode loop's own forwards"). One length for every size (``width + max_new_tokens / 2``)
    made the wide phase's cost in ``T`` too flat (drafting long chains there) and the tail's too
    steep: the cache read, which does not grow with ``T``, was too small a share of it. A
    sliding-window model's cache stays inside the window."""
    hi = width + max_new_tokens
    if window is not None:
        hi = max(1, min(hi, window - 2 - max_draft))
    lo = min(width, hi)
    return lambda a: lo + round((hi - lo) * (1 - a / (rows + 1)))


def _best_times(
    fns: Sequence[Callable[[], object]], repeats: int, long: float = LONG_FORWARD_S
) -> list[float]:
    """Fastest run of each of ``fns`` over ``repeats`` passes taken in turn, so a burst of load from
    other processes hits different cells in different passes instead of every run of one cell
    (which bent the table's shape in ``T``, and with it every later choice); a cell whose run took
    ``long`` seconds is not run again."""
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if math.isfinite(best[i]) and best[i] >= long:
                continue
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _prefilled_cache(
    model: torch.nn.Module, a: int, clen: int, vocab: int, gen: torch.Generator, device: torch.device
) -> Any:
    """An ``a x clen`` cache of random ids that appends in place: one row's prefill, repeated to
    ``a`` rows. The timed forwards see an ``a x clen`` cache either way, and prefilling every size
    cost most of the calibration (the widest prefill alone is a training-sized forward)."""
    ids = torch.randint(0, vocab, (1, clen), generator=gen).to(device)
    cache = output_cache(model(input_ids=ids, use_cache=True, logits_to_keep=1))
    if a > 1:
        repeat_cache_rows(cache, a)
    reserve_cache_room(cache, CACHE_ROOM)
    return cache


def _cached_forward(
    model: torch.nn.Module, cache: Any, clen: int, step: torch.Tensor, lay: Any, lean: LeanForward | None,
    cache_kw: str, sync: Callable[[], Any],
) -> Callable[[], None]:  # fmt: skip
    """One timed cell: the decode loop's forward of ``step: [A, T]`` on ``cache`` (its layout chosen
    for ``T``, the lean forward where the loop runs it), then the cache cropped back to ``clen``."""
    a, t = step.shape
    device = step.device
    mask = torch.ones(a, clen + t, dtype=torch.long, device=device)
    pos = torch.arange(clen, clen + t, device=device).expand(a, t)
    extra = {} if lay is None else {LAYOUT_KWARG: lay}
    model_kw = {cache_kw: cache, **extra}

    def fwd() -> None:
        if lay is not None:
            lay.choose(step.shape[1])
        if lean is not None:
            lean(step, mask, pos, cache, extra=extra)
        else:
            model(input_ids=step, attention_mask=mask, position_ids=pos, use_cache=True, **model_kw)
        crop_cache(cache, clen)
        sync()

    return fwd


@torch.no_grad()
def calibrate_policy(
    model: torch.nn.Module, batch_sizes: Sequence[int], tokens: Sequence[int],
    context_len: int | Callable[[int], int], repeats: int = 2, layout: Callable[[int], Any] | None = None,
    lean: LeanForward | None = None,
) -> dict[int, list[float]]:  # fmt: skip
    """Time the policy's cached forward of ``A x T`` tokens on a ``context_len`` cache (random ids;
    a callable gives the context per batch size ``A``).

    The forwards are the decode loop's: the cache appends in place (``reserve_cache_room``) and,
    with ``layout(A)`` (a :class:`~.decode_attention.DecodeLayout` for ``A`` rows, or None), they
    carry the decode attention's layout, so the caller selects that kernel around the call: online
    rescaling keeps the calibrated *shape* in ``T``, so it must be the loop's own (the log's
    "Calibration on the decode loop's own forwards"). Best of ``repeats`` runs after a warm-up.
    """
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator, union-attr]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    table: dict[int, list[float]] = {}
    cache_kw = cache_kwarg(model)
    for a in batch_sizes:
        clen = context_len(a) if callable(context_len) else context_len
        cache = _prefilled_cache(model, a, clen, vocab, gen, device)
        lay = None if layout is None else layout(a)
        # each cell's random ids drawn from the one generator, in cell order
        steps = [torch.randint(0, vocab, (a, t), generator=gen).to(device) for t in tokens]
        fwds = [_cached_forward(model, cache, clen, step, lay, lean, cache_kw, sync) for step in steps]
        fwds[0]()  # warm-up: once per batch size (a new cache size), not per cell
        row = _best_times(fwds, repeats)
        # cost never decreases with more tokens; enforce it against timing noise
        for j in range(1, len(row)):
            row[j] = max(row[j], row[j - 1])
        table[a] = row
    return table


#: context of the draft's start-up timing: kept short, since a proposal's cost hardly depends on it while the
#: untimed first proposal indexes or encodes all of it (:meth:`CostModel.observe_draft` refines the estimate)
DRAFT_CONTEXT = 64


@torch.no_grad()
def calibrate_draft(
    draft: DraftModel, model: torch.nn.Module, cost: CostModel, params: SamplingParams, context_len: int,
    max_tokens: int, repeats: int = 2,
) -> None:  # fmt: skip
    """Time ``draft.propose`` of 1 and ``max_tokens`` tokens at every calibrated batch size on a
    context of random ids (random policy features for hidden-state drafts) of at most
    :data:`DRAFT_CONTEXT` tokens; fills ``cost.draft_fixed`` / ``cost.draft_per_token``."""
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator, union-attr]
    hid = int(getattr(model, "config").hidden_size)  # noqa: B009
    gen = torch.Generator(device="cpu").manual_seed(0)
    ctx, kmax, reps = min(context_len, DRAFT_CONTEXT), max_tokens, repeats
    for a in cost.batch_sizes:
        toks = torch.randint(1, vocab, (a, ctx + 2 * reps + 2), generator=gen).to(device)
        rows = torch.arange(a, device=device)
        draft.reset(toks[:, :ctx], torch.ones_like(toks[:, :ctx]), rows)

        def context(
            length: int, new: int, toks: torch.Tensor = toks, rows: torch.Tensor = rows
        ) -> DraftContext:
            na = toks.shape[0]
            h = torch.randn(na, new, hid, generator=gen).to(device) if draft.needs_hidden_states else None
            return DraftContext(
                toks[:, :length], torch.full((na,), length, device=device), rows, rows,
                hidden=None if h is None else h[:, -1], new_hidden=h,
                num_new=None if h is None else torch.full((na,), new, device=device),
            )  # fmt: skip

        draft.propose(context(ctx, ctx), 1, params, None)  # warm-up / prefill
        times = {1: float("inf"), kmax: float("inf")}
        for i in range(reps):
            for j, k in enumerate(times):
                c = context(ctx + 1 + 2 * i + j, 1)
                t0 = time.perf_counter()
                draft.propose(c, k, params, None)
                times[k] = min(times[k], time.perf_counter() - t0)
        per = max((times[kmax] - times[1]) / max(kmax - 1, 1), 1e-7)
        cost.draft_fixed[a] = max(times[1] - per, 1e-7)
        cost.draft_per_token[a] = per
