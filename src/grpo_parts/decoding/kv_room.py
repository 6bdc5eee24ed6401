"""In-place KV cache buffers for the speculative sampler and its drafts (re-exported by ``compat``),
bit-identical to transformers' (docs/speculative.md, "Appends in place" and "Row drops move, not gather").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: columns of room a cache layer's buffers get beyond what they hold (then regrown): at least this,
#: and at least :data:`ROOM_FRACTION` of the columns held (up to :data:`ROOM_MAX`)
CACHE_ROOM = 16
#: regrowth is geometric (a quarter of what a buffer holds), so a rollout copies its cache
#: ~``log(1 + T/P) / log(1.25)`` times, not once per :data:`CACHE_ROOM` columns (docs/results.md;
#: the log's "Geometric KV room, buffers from the prefill on")
ROOM_FRACTION = 0.25
#: ... but never more than this many columns: a long GPU cache gets a small share of extra memory,
#: and is still copied only once per this many appended columns
ROOM_MAX = 256


def reserve_cache_room(cache: Any, slack: int) -> int:
    """Let every plain ``DynamicLayer`` of ``cache`` append in place: its keys and values become
    views of buffers (made now for layers that hold tensors, else at their first append) with room
    for at least ``slack`` more columns (:func:`_grow`), so a forward writes its new columns instead
    of copying the whole cache (``DynamicLayer.update`` is ``torch.cat``). ``crop`` (a slice) keeps
    the buffer; anything that replaces the tensors (row selection, compaction) gets a new buffer at
    the next append. Other layer types are left alone. Returns how many layers were converted."""
    layers = getattr(cache, "layers", None) or []
    done = 0
    for ly in layers:
        base: Any = type(ly)
        if base.__name__ != "DynamicLayer" and not getattr(base, "_grpo_parts_room", False):
            continue
        if not getattr(base, "_grpo_parts_room", False):
            ly.__class__ = _room_class(base)
        ly._room = max(1, int(slack))
        keys, values = getattr(ly, "keys", None), getattr(ly, "values", None)
        if (
            getattr(ly, "is_initialized", True)
            and isinstance(keys, torch.Tensor)
            and isinstance(values, torch.Tensor)
            and keys.dim() == 4
            and ly._buffers() is None
        ):
            # buffers now (a prefill's cache): the first decode step must not pay for copying it
            ly._use(_grow(keys, 0, ly._room), _grow(values, 0, ly._room), keys.shape[2])
        done += 1
    return done


# The methods a converted cache layer gets (:func:`_room_class`). They are put in the class dict of a
# direct subclass of the layer's class, not mixed in from a class of their own: a mixin base changes
# the instance layout CPython compares when ``reserve_cache_room`` swaps ``__class__`` in place.
# ``self._room_base`` is the layer's own class: whatever these do not handle goes to it.


def _room_update(
    self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    keys: Any = getattr(self, "keys", None)
    values: Any = getattr(self, "values", None)
    if (
        not getattr(self, "is_initialized", True)
        or keys is None
        or keys.dim() != 4
        or key_states.dtype != keys.dtype
        or key_states.device != keys.device
    ):  # cat's type promotion / device rules: the base class
        return self._room_base.update(self, key_states, value_states, *args, **kwargs)
    n, t = keys.shape[-2], key_states.shape[-2]
    kb: Any = getattr(self, "_kbuf", None)
    vb: Any = getattr(self, "_vbuf", None)
    if not (_is_prefix_view(keys, kb, n + t) and _is_prefix_view(values, vb, n + t)):
        kb, vb = _grow(keys, t, self._room), _grow(values, t, self._room)
    kb[:, :, n : n + t] = key_states
    vb[:, :, n : n + t] = value_states
    self._use(kb, vb, n + t)
    return self.keys, self.values


def _room_use(self: Any, kb: torch.Tensor, vb: torch.Tensor, n: int) -> None:
    """Hold ``kb``/``vb`` as the buffers, their first ``n`` columns as keys/values."""
    self._kbuf, self._vbuf = kb, vb
    self.keys, self.values = kb[:, :, :n], vb[:, :, :n]


def _room_buffers(self: Any) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(key buffer, value buffer, columns in use)`` when the layer's keys/values are prefix
    views of its in-place buffers, else None."""
    kb: Any = getattr(self, "_kbuf", None)
    vb: Any = getattr(self, "_vbuf", None)
    keys: Any = getattr(self, "keys", None)
    values: Any = getattr(self, "values", None)
    if (
        keys is None
        or keys.dim() != 4
        or not (_is_prefix_view(keys, kb, keys.shape[2]) and _is_prefix_view(values, vb, values.shape[2]))
    ):
        return None
    return kb, vb, keys.shape[2]


def _room_batch_select_indices(self: Any, indices: torch.Tensor) -> None:
    bufs = self._buffers()
    if bufs is None:
        return self._room_base.batch_select_indices(self, indices)  # type: ignore[no-any-return]
    # one gather of the buffers (the room included) instead of a gather now and a copy at the next append
    kb, vb, n = bufs
    self._use(kb[indices], vb[indices], n)


def _room_move_rows(self: Any, dst: torch.Tensor, src: torch.Tensor, rows: int) -> bool:
    """Copy rows ``src`` into rows ``dst`` and keep the first ``rows``, in the buffers (False:
    the layer holds no in-place buffers; nothing done)."""
    bufs = self._buffers()
    if bufs is None:
        return False
    kb, vb, n = bufs
    if dst.numel():
        kb[dst], vb[dst] = kb[src], vb[src]
    self._use(kb[:rows], vb[:rows], n)  # views of the first rows: no copy
    return True


@functools.cache
def _room_class(base: Any) -> Any:
    """``base`` (a cache layer class) with the in-place methods above, under its own name; one
    class per base."""
    attrs = {
        "update": _room_update,
        "batch_select_indices": _room_batch_select_indices,
        "move_rows": _room_move_rows,
        "_buffers": _room_buffers,
        "_use": _room_use,
        "_grpo_parts_room": True,
        "_room_base": base,
    }
    return type(base.__name__, (base,), attrs)


def drop_cache_rows(cache: Any, keep: torch.Tensor) -> torch.Tensor:
    """Remove the rows where ``keep: [A]`` (bool) is False, in place, moving rather than gathering:
    the live rows among the last ``K = keep.sum()`` take the dropped rows' slots among the first
    ``K`` and every layer keeps its first ``K`` rows. Returns ``order: [K]``, the old index of each
    new row (the caller reorders its per-row state by it). Layers with in-place buffers
    (:func:`reserve_cache_room`) copy only the moved rows; any other layer (or a cache without
    ``layers``) gets ``batch_select_indices(order)``, a gather of every row."""
    k = int(keep.sum())
    dst = (~keep[:k]).nonzero().squeeze(1)
    src = keep[k:].nonzero().squeeze(1) + k
    order = torch.arange(k, device=keep.device)
    order[dst] = src
    layers = getattr(cache, "layers", None)
    if not layers:
        cache.batch_select_indices(order)
        return order
    for ly in layers:
        move = getattr(ly, "move_rows", None)
        if move is None or not move(dst, src, k):
            ly.batch_select_indices(order)
    return order


def _is_prefix_view(x: torch.Tensor, buf: torch.Tensor | None, need: int) -> bool:
    """``x`` is ``buf[:, :, :n]`` and ``buf`` holds at least ``need`` columns."""
    return (
        buf is not None
        and x.data_ptr() == buf.data_ptr()
        and x.stride() == buf.stride()
        and x.shape[:2] == buf.shape[:2]
        and x.shape[3] == buf.shape[3]
        and need <= buf.shape[2]
    )


def _grow(x: torch.Tensor, append: int, room: int) -> torch.Tensor:
    """A buffer holding ``x: [B, H, n, D]`` with room for ``append`` more columns plus
    ``max(room, min(ROOM_FRACTION * (n + append), ROOM_MAX))``."""
    need = x.shape[2] + append
    spare = max(room, min(int(ROOM_FRACTION * need), ROOM_MAX))
    buf = x.new_empty(x.shape[0], x.shape[1], need + spare, x.shape[3])
    buf[:, :, : x.shape[2]] = x
    return buf
