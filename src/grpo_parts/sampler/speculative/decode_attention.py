"""Decode attention that reads each group's prompt K/V once (speculative sampler).

The first ``P`` cache columns (the prompt) are identical within a group and never moved by the decode
loop, so :func:`shared_prompt_attention` scores them with the group's queries stacked and the
completion columns per row, in one softmax with the forward's own mask. Other GQA decode forwards
run :func:`grouped_query_attention` (no per-head ``repeat_kv`` copy of the cache); anything else runs
the model's own attention. docs/speculative.md, "Decode attention over the shared prompt".
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...compat import own_attention, own_attention_function, register_attention_function, select_attention
from ...errors import NotSupportedError

#: name under which the attention function is registered with transformers
KERNEL_NAME = "grpo_decode_shared_prompt"
#: forward keyword argument that carries the :class:`DecodeLayout`
LAYOUT_KWARG = "grpo_decode_layout"
#: attention implementations whose decode attention the kernel reproduces (plain causal softmax)
OWN_IMPLEMENTATIONS = ("sdpa", "eager")
#: cost rule (docs/results.md; the log's "Decode attention over the shared prompt"): the shared
#: path pays when the active rows per group average at least this many ...
MIN_ROWS_PER_GROUP = 4.0
#: ... and at least this many rows are active (below, SDPA's per-row cost is small enough)
MIN_ROWS = 64
#: the reason a rollout of one row per prompt gives (nothing to share)
GROUP_SIZE_ONE = "group_size 1: no prompt is shared"


@dataclass
class DecodeLayout:
    """Where the prompt of each active row lives: cache columns ``[0, prompt_len)``, identical in
    all rows of a group. ``group_id: [A]`` numbers the groups ``0 .. U-1``, ``rank: [A]`` is a row's
    place in its group, ``reps: [U]`` one row of each group; ``use_shared``: the cost rule's choice
    for the next forward; ``calls``: attention calls per path so far."""

    prompt_len: int
    group_id: torch.Tensor
    rank: torch.Tensor
    reps: torch.Tensor
    max_group: int
    #: rows are the groups' rows in order, every group full (``[U * Gmax]``): views, no scatter
    dense: bool = False
    use_shared: bool = True
    #: skip the cost rule (every decode forward takes the shared path)
    always: bool = False
    calls: dict[str, int] = field(default_factory=lambda: {"shared_prefix": 0, "plain": 0, "plain_gqa": 0})
    #: the shared path may run (False: one row per prompt, or the config turned it off)
    shared_ok: bool = True
    #: the last forward's mask and its additive form (every layer of a forward gets the same mask)
    _mask: tuple[Any, torch.Tensor] | None = field(default=None, repr=False)
    _folded: tuple[Any, Any, torch.Tensor | None] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls, group: torch.Tensor, prompt_len: int, calls: dict[str, int] | None = None,
        always: bool = False, shared_ok: bool = True,
    ) -> DecodeLayout:  # fmt: skip
        """Layout of the active rows whose prompt (group) index is ``group: [A]``."""
        uniq, gid = torch.unique(group, return_inverse=True)
        counts = torch.bincount(gid, minlength=uniq.numel())
        order = torch.argsort(gid, stable=True)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(gid)
        rank[order] = torch.arange(gid.numel(), device=gid.device) - start[gid[order]]
        gm = int(counts.max()) if counts.numel() else 0
        i = torch.arange(gid.numel(), device=gid.device)
        dense = gid.numel() == gm * uniq.numel() and bool(((gid == i // gm) & (rank == i % gm)).all())
        lay = cls(prompt_len, gid, rank, order[start], gm, dense, always=always, shared_ok=shared_ok)
        if calls is not None:
            lay.calls = calls
        return lay

    def for_rows(self, group: torch.Tensor) -> DecodeLayout:
        """The layout of another set of active rows (``group: [A']``), with this one's settings and
        call counts (rows finished or moved)."""
        return DecodeLayout.build(group, self.prompt_len, self.calls, self.always, self.shared_ok)

    def choose(self, query_len: int) -> bool:
        """The cost rule for a forward of ``query_len`` tokens per row: sets and returns ``use_shared``."""
        a, u = self.group_id.numel(), self.reps.numel()
        self.use_shared = self.shared_ok and (self.always or (a >= MIN_ROWS_PER_GROUP * u and a >= MIN_ROWS))
        return self.use_shared

    def additive_mask(self, mask: torch.Tensor | None, t: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` (boolean, True = attend, or additive; None = causal over the last ``t`` of ``n``
        columns) as an additive ``[A, 1|H, t, n]`` mask, converted once per forward."""
        if self._mask is not None and self._mask[0] is mask and self._mask[1].shape[-2:] == (t, n):
            return self._mask[1]
        m = torch.ones(t, n, dtype=torch.bool).tril(n - t) if mask is None else mask[..., :n]
        add = m.to(dtype) if m.dtype != torch.bool else torch.zeros(m.shape, dtype=dtype, device=m.device)
        if m.dtype == torch.bool:
            add.masked_fill_(~m, torch.finfo(dtype).min)
        self._mask = (mask, add)
        return add

    def folded_mask(self, mask: torch.Tensor | None, h: int, hk: int, t: int, n: int) -> torch.Tensor | None:
        """``mask`` for queries folded to ``[A, Hk, r * T, D]`` (row ``i * T + j`` = head ``i`` of the
        group, query ``j``): ``[A, 1|Hk, r * T, n]``, built once per forward (None stays None for
        one query: nothing to mask; a block of ``T > 1`` gets its causal mask)."""
        key = (id(mask), h, hk, t, n)
        if self._folded is not None and self._folded[0] is mask and self._folded[1] == key:
            return self._folded[2]
        r = h // hk
        if mask is None:
            m = None if t == 1 else torch.ones(t, n, dtype=torch.bool).tril(n - t).repeat(r, 1)
        else:
            m = mask[..., :n]
            if m.shape[1] == 1:
                m = m.expand(-1, -1, r, -1) if t == 1 else m.repeat(1, 1, r, 1)
            else:  # one mask per query head: heads of a KV head are consecutive
                m = m.expand(-1, h, -1, -1).reshape(m.shape[0], hk, r * t, n)
        self._folded = (mask, key, m)
        return m


def register() -> str:
    """Register :func:`decode_attention` (with the mask builder of the model's own implementation)."""
    register_attention_function(KERNEL_NAME, decode_attention, mask="own")
    return KERNEL_NAME


class DecodeRows(Protocol):
    """What :func:`shared_prompt_decoding` reads and sets on the decode loop's state
    (:class:`~grpo_parts.sampler.speculative.decode_loop.DecodeState`)."""

    model: Any
    #: ``[N]`` the prompt (group) of every row; ``act: [A]`` the rows still generating
    group: torch.Tensor
    act: torch.Tensor
    #: set for the block: the rows' :class:`DecodeLayout` (None: the policy's own attention)
    layout: DecodeLayout | None

    @property
    def width(self) -> int:
        """The prompt's cache columns (left-padded prompts), the same in every row of a group."""
        ...


@contextlib.contextmanager
def shared_prompt_decoding(st: DecodeRows, reasons: list[str], mode: str) -> Iterator[None]:
    """For the block (the decode loop): :func:`decode_kernel`, and give ``st`` a :class:`DecodeLayout`.
    The shared-prompt path runs when ``reasons`` is empty (``mode == "always"``: no cost rule);
    otherwise the kernel still serves the GQA forwards without copying K/V per head."""
    with decode_kernel(st.model, mode) as on:
        if on:
            st.layout = DecodeLayout.build(
                st.group[st.act], st.width, always=mode == "always", shared_ok=not reasons
            )
        yield


@contextlib.contextmanager
def decode_kernel(model: torch.nn.Module, mode: str) -> Iterator[bool]:
    """Select the kernel on ``model`` for the block (True) unless ``mode == "off"`` or it cannot
    reproduce the model's attention (False: nothing changes). The decode loop and the cost model's
    start-up timing (which must time the forwards the loop will run) both enter it."""
    if mode == "off" or kernel_reasons(model):
        yield False
        return
    with select_attention(model, register()):
        yield True


def decode_attention_reasons(model: torch.nn.Module, group_size: int) -> list[str]:
    """Why the shared-prompt decode attention is not used for ``model`` (empty: it is)."""
    out = [GROUP_SIZE_ONE] if group_size < 2 else []
    return out + kernel_reasons(model)


def kernel_reasons(model: torch.nn.Module) -> list[str]:
    """Why the decode attention kernel (either path) cannot stand in for ``model``'s attention."""
    cfg: Any = getattr(model, "config", None)
    out = []
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in OWN_IMPLEMENTATIONS:
        out.append(f"model: attention {impl!r} (the kernel reproduces {' and '.join(OWN_IMPLEMENTATIONS)})")
    sub = getattr(cfg, "get_text_config", lambda: cfg)()
    for attr, what in (
        ("sliding_window", "sliding-window attention"),
        ("attn_logit_softcapping", "attention logit soft-capping"),
        ("kv_lora_rank", "multi-head latent attention"),
    ):
        if getattr(sub, attr, None) and (
            attr != "sliding_window" or getattr(sub, "use_sliding_window", True)
        ):
            out.append(f"model: {what} ({attr}={getattr(sub, attr)})")
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        out.append(f"model: {type(model).__name__}.forward takes no **kwargs to carry the layout")
    return out


def decode_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers ``AttentionInterface`` function: shared-prompt attention when the forward
    carries a :class:`DecodeLayout` that chose it and nothing in the call changes the maths
    (sliding window, soft-cap, sinks, dropout, a cache narrower than the prompt); otherwise, for a
    GQA model, :func:`grouped_query_attention`, and else the model's own attention. Returns
    ``([A, T, H, Dv], None)`` as transformers' functions do."""
    lay: DecodeLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if lay is None:
        return _own(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    unusual = (
        any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux"))
        or dropout > 0.0
        or query.shape[0] != lay.group_id.numel()
        or query.shape[1] % key.shape[1] != 0
    )
    if unusual or not lay.use_shared or key.shape[2] <= lay.prompt_len:
        lay.calls["plain"] += 1
        if unusual or query.shape[1] == key.shape[1]:
            return _own(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        # GQA: the model's own sdpa/eager attention copies K/V per query head (repeat_kv) whenever a
        # mask is given, i.e. in every padded decode step; this reads each KV head once
        lay.calls["plain_gqa"] += 1
        out = grouped_query_attention(query, key, value, attention_mask, lay, scaling)
        return out.transpose(1, 2).contiguous(), None
    lay.calls["shared_prefix"] += 1
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = shared_prompt_attention(query, key, value, attention_mask, lay, scale)
    return out.transpose(1, 2).contiguous(), None


def grouped_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    lay: DecodeLayout, scale: float | None,
) -> torch.Tensor:  # fmt: skip
    """``softmax(q k^T * scale + mask) v`` for ``query: [A, H, T, D]`` over ``key/value: [A, Hk, L,
    D/Dv]`` (``H = r * Hk``) without copying K/V per query head: the ``r`` heads that share a KV
    head are folded into the query length (``[A, Hk, r * T, D]``) of one SDPA call and the mask
    repeated to match (once per forward, ``lay``). ``mask``: boolean (True = attend) or additive,
    ``[A, 1|H, T, >= L]``; None = causal over the last ``T`` columns. Returns ``[A, H, T, Dv]``."""
    a, h, t, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    q = query.reshape(a, hk, (h // hk) * t, d)
    m = lay.folded_mask(mask, h, hk, t, n)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scale)
    return out.view(a, h, t, -1)


def _own(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, dropout: float, scaling: float | None, kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    own = own_attention(getattr(module, "config", None)) or "sdpa"
    fn = own_attention_function(module, own)
    if fn is None:
        raise NotSupportedError("decode attention", [f"no attention function for {own!r} to fall back to"])
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)  # type: ignore[no-any-return]


def _to_groups(x: torch.Tensor, lay: DecodeLayout, hk: int) -> torch.Tensor:
    """``[A, H, T, C]`` -> ``[U, Hk, Gmax * (H / Hk) * T, C]``: each group's rows stacked per KV
    head (rows a group no longer has are zeros)."""
    a, h, t, c = x.shape
    u, gm = lay.reps.numel(), lay.max_group
    if lay.dense:
        xg = x.reshape(u, gm, h, t, c)  # full groups in order: no scatter
    else:
        xg = x.new_zeros(u * gm, h, t, c).index_copy_(0, lay.group_id * gm + lay.rank, x)
    return xg.reshape(u, gm, hk, (h // hk) * t, c).transpose(1, 2).reshape(u, hk, gm * (h // hk) * t, c)


def _from_groups(y: torch.Tensor, lay: DecodeLayout, h: int, t: int) -> torch.Tensor:
    """Inverse of :func:`_to_groups`: ``[U, Hk, Gmax * r * T, C]`` -> ``[A, H, T, C]``."""
    u, hk, _, c = y.shape
    yg = y.view(u, hk, lay.max_group, (h // hk) * t, c).transpose(1, 2).reshape(-1, h, t, c)
    return yg if lay.dense else yg.index_select(0, lay.group_id * lay.max_group + lay.rank)


def shared_prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    lay: DecodeLayout, scale: float,
) -> torch.Tensor:  # fmt: skip
    """``softmax(q k^T * scale + mask) v`` for ``query: [A, H, T, D]`` over ``key/value: [A, Hk, L,
    D/Dv]`` (GQA: ``H`` a multiple of ``Hk``), reading columns ``< P`` of group ``g`` from row
    ``lay.reps[g]`` only. ``mask``: boolean (True = attend) or additive, ``[A, 1|H, T, >= L]``;
    None = causal over the last ``T`` columns. Softmax in float32 at least (as eager). ``[A, H, T, Dv]``."""
    a, h, t, d = query.shape
    hk, n, p = key.shape[1], key.shape[2], lay.prompt_len
    r = h // hk
    q = query * scale  # scaled once here, not the [A, H, T, L] scores
    # [U, Hk, P, D]: the prompt, once per group (index_select: advanced indexing is much slower here)
    kp, vp = key[:, :, :p].index_select(0, lay.reps), value[:, :, :p].index_select(0, lay.reps)
    s_p = _from_groups(_to_groups(q, lay, hk) @ kp.transpose(-1, -2), lay, h, t)  # [A, H, T, P]
    s_c = (q.reshape(a, hk, r * t, d) @ key[:, :, p:].transpose(-1, -2)).view(a, h, t, n - p)
    s = torch.cat([s_p, s_c], -1).add_(lay.additive_mask(mask, t, n, s_p.dtype))
    pr = torch.softmax(s, -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(query.dtype)
    out = _from_groups(_to_groups(pr[..., :p], lay, hk) @ vp, lay, h, t)
    return out + (pr[..., p:].reshape(a, hk, r * t, n - p) @ value[:, :, p:]).view(a, h, t, -1)
