"""The shared-prefix attention backend (:mod:`.backend`) and its attention function's name and
registration; docs/attention.md, "How it works", walks through the package."""

from __future__ import annotations

from .backend import SharedPrefixAttention
from .run import KERNEL_NAME, register_attention

__all__ = ["KERNEL_NAME", "SharedPrefixAttention", "register_attention"]
