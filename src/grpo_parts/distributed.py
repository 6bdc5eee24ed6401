"""Agreement across processes: every rank that shares sharded weights (FSDP, DeepSpeed ZeRO) or a
gradient reduction (DDP) must run equally many model calls, or one waits forever in a collective.

The samplers (one more decoding step while any rank decodes), the shared-prefix plan (as many grids
on every rank) and the framework doors (fall back on every rank together) all agree through these
three functions.
"""

from __future__ import annotations

from typing import Any

import torch


def ranks_of(group: Any = None) -> int:
    """Processes in ``group`` (default: every process) that must agree on the number of model calls;
    1 when torch.distributed is not initialised."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def agree_max(values: list[int], group: Any = None, device: torch.device | None = None) -> list[int]:
    """The element-wise largest ``values`` over the ranks of ``group`` (one all-reduce; ``values`` itself on
    one process). The tensor lives on the CPU for gloo/MPI groups, on ``device`` otherwise (NCCL)."""
    if ranks_of(group) <= 1:
        return list(values)
    dist = torch.distributed
    name = str(dist.get_backend(group))
    on = torch.device("cpu") if ("gloo" in name or "mpi" in name or device is None) else device
    if on.type == "cuda" and on.index is None:
        on = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.long, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def agree_on_calls(count: int, group: Any = None, device: torch.device | None = None) -> int:
    """The largest ``count`` over the ranks of ``group`` (:func:`agree_max`)."""
    return agree_max([count], group, device)[0]
