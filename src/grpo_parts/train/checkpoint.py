"""Checkpoints: one file per save, written atomically (temp name, then rename), ``last.pt`` = newest.

A checkpoint is :meth:`GRPOTrainer.state_dict` -- policy, optimizer, draft state, data position and
every RNG state -- plus the config it was made with, so resuming continues exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import GRPOPartsError

LAST = "last.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any], config_json: dict[str, Any]) -> Path:
    """Write ``run_dir/checkpoints/last.pt`` (atomically) and return its path."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / LAST
    tmp = ckpt_dir / f".{LAST}.tmp"
    torch.save({"state": state, "config": config_json}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """``{"state": ..., "config": ...}`` from ``run_dir/checkpoints/last.pt``."""
    path = run_dir / "checkpoints" / LAST
    if not path.is_file():
        raise GRPOPartsError(
            f"resume: no checkpoint at {str(path)!r} (was the run saved with checkpoint_every?)"
        )
    # our own file: optimizer and RNG states need full unpickling
    return dict(torch.load(path, map_location="cpu", weights_only=False))
