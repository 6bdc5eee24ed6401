"""The shared-prefix attention backend (Prefix Grouper): each prompt encoded once per group.

A call reads check -> plan -> run, one file each:

* :mod:`.backend` -- :class:`SharedPrefixAttention`, the ``AttentionBackend`` itself;
* :mod:`.guard` -- the check: which architectures are served, and that every layer saw the layout;
* :mod:`.plan` -- one plan per call, from the batch's :mod:`.facts`: the grids (:mod:`.chunking`:
  a batch split into model calls under a token budget, the same number on every rank) and the
  layout (:mod:`.layout_choice`: one padded row per group, or every group packed into one row);
* :mod:`.run` -- the plan run: each call's layout built (:mod:`.layout`, :mod:`.padding_free`), one
  forward each with the kernel selected, un-grouped, merged; and the one-token probe;
* :mod:`.kernels`, :mod:`.cascade`, :mod:`.varlen`, :mod:`.varlen_eager` -- the attention kernels
  (prefix + own suffix merged by log-sum-exp; variable-length packed rows);
* :mod:`.packed` -- the backend over packed (remove-padding) inputs, as verl hands them.

The package's names: the backend, and the name (:data:`.run.KERNEL_NAME`) and registration of its
attention function for a model that selects it itself.
"""

from __future__ import annotations

from .backend import SharedPrefixAttention
from .run import KERNEL_NAME, register_attention

__all__ = ["KERNEL_NAME", "SharedPrefixAttention", "register_attention"]
