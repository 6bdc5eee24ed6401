"""KV-cache bookkeeping shared by the KV-cached drafts (the EAGLE head and the small LM).

Rows accept different counts, so a call feeds each row's new entries right-aligned and shorter rows
leave masked *holes* (explicit positions, so a hole never shifts one); the ``k - 1`` speculative
entries a call appends are cropped by the next.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import crop_cache, new_dynamic_cache, select_cache_rows
from ..decoding import CACHE_ROOM, compact_cache, reserve_cache_room


class DraftKVState:
    """``cache`` (a transformers ``DynamicCache``), ``mask: [A, L]`` and ``rows: [A]`` (rollout rows,
    in cache order) of one rollout."""

    def __init__(self, rows: torch.Tensor):
        self.cache: Any = new_dynamic_cache()
        self.mask = torch.zeros(rows.shape[0], 0, dtype=torch.long, device=rows.device)
        self.rows = rows.clone()
        self.spec = 0  # speculative entries appended by the last call
        self.room_layers = 0  # layers that append in place (``compat.reserve_cache_room``)

    def begin_call(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Crop the last call's speculative entries, drop rows that finished since (returns the
        kept indices, for the caller's own per-row state, or None), compact when mostly holes."""
        if self.spec:
            crop_cache(self.cache, self.mask.shape[1] - self.spec)
            self.mask = self.mask[:, : -self.spec]
            self.spec = 0
        sel = None
        if not torch.equal(rows, self.rows):
            pos_of = {int(r): i for i, r in enumerate(self.rows.tolist())}
            sel = torch.tensor([pos_of[int(r)] for r in rows.tolist()], device=self.mask.device)
            select_cache_rows(self.cache, sel)
            self.mask, self.rows = self.mask[sel], rows.clone()
        if self.mask.shape[1] > 64 and float(self.mask.sum(-1).max()) < 0.5 * self.mask.shape[1]:
            new = compact_cache(self.cache, self.mask)  # too many holes: gather live entries
            self.mask = self.mask if new is None else new
        if not self.room_layers:  # appends in place once the first call created the layers
            self.room_layers = reserve_cache_room(self.cache, CACHE_ROOM)
        return sel

    def append(self, valid: torch.Tensor) -> torch.Tensor:
        """Extend the mask by ``valid: [A, m]`` (the entries about to be fed); returns the mask."""
        self.mask = torch.cat([self.mask, valid], 1)
        return self.mask
