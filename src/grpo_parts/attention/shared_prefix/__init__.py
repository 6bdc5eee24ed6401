"""The shared-prefix attention backend (Prefix Grouper): each prompt encoded once per group.

* :mod:`.backend` -- :class:`SharedPrefixAttention`, the ``AttentionBackend`` itself;
* :mod:`.layout`, :mod:`.padding_free`, :mod:`.layout_choice` -- the grouped layouts (one padded row
  per group, or every group packed into one row) and the cost rule that picks one per call;
* :mod:`.chunking` -- splitting a batch into calls under a token budget, the same number on every rank;
* :mod:`.grouped_forward` -- one forward of the model with the kernel selected;
* :mod:`.kernels`, :mod:`.cascade`, :mod:`.varlen`, :mod:`.varlen_eager` -- the attention kernels
  (prefix + own suffix merged by log-sum-exp; variable-length packed rows);
* :mod:`.guard` -- which architectures are served, and the check that every layer saw the layout;
* :mod:`.packed` -- the backend over packed (remove-padding) inputs, as verl hands them.

``grpo_parts.attention.shared_prefix`` was one module in earlier 0.1 commits; the names users
imported from it are re-exported here.
"""

from __future__ import annotations

from ...compat import select_attention
from .backend import SharedPrefixAttention
from .grouped_forward import KERNEL_NAME, register_attention

__all__ = ["KERNEL_NAME", "SharedPrefixAttention", "register_attention", "select_attention"]
