"""grpo_parts inside OpenRLHF 0.11.2's Ray GRPO loop (thin translation layer, no maths of its own).
OpenRLHF has no plugin registry, so the parts go in by subclassing, and :mod:`.launch` runs OpenRLHF's own
``cli/train_ppo_ray`` with that script's imports resolving to the subclasses (:mod:`._scoped`; nothing global
is reassigned). Each module imports OpenRLHF only when imported itself. docs/adapters/openrlhf.md."""

from __future__ import annotations

from .config import OpenRLHFPartsConfig

__all__ = ["OpenRLHFPartsConfig"]
