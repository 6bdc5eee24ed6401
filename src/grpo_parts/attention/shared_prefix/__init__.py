"""The shared-prefix attention backend (Prefix Grouper): each prompt encoded once per group.

A call reads check (:mod:`.guard`) -> plan (:mod:`.plan`) -> run (:mod:`.run`), one file each;
docs/attention.md, "How it works", walks through the package. Its names: the backend, and the name
(:data:`.run.KERNEL_NAME`) and registration of its attention function.
"""

from __future__ import annotations

from .backend import SharedPrefixAttention
from .run import KERNEL_NAME, register_attention

__all__ = ["KERNEL_NAME", "SharedPrefixAttention", "register_attention"]
