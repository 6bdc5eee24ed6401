"""``--resume RUN/checkpoints/step-N --rewind``: resume from an earlier checkpoint of a run that went
further, after moving the later state aside into ``RUN/rewound-K/`` (later checkpoints and ``model/``
moved, every other file copied): nothing is overwritten or deleted (docs/training.md, "Stopping and
resuming")."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ...errors import GRPOPartsError
from .checkpoint import LAST, Checkpoint, atomic_write_text, checkpoint_steps, fsync_path, step_name

log = logging.getLogger("grpo_parts.train")
PREFIX = "rewound-"
#: folders of the run that a rewind moves (rather than copies) when they belong to the later state
MOVED = ("model",)


def later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    return [p for s, p in sorted(checkpoint_steps(run_dir / "checkpoints").items()) if s > step]


def check_rewind(run_dir: Path, ckpt: Checkpoint, rewind: bool) -> None:
    """Refuse an earlier checkpoint without ``--rewind``, and ``--rewind`` with nothing to rewind."""
    later = later_checkpoints(run_dir, ckpt.step)
    if later and not rewind:
        newest = later[-1]
        raise GRPOPartsError(
            f"resume: {str(ckpt.folder)!r} is step {ckpt.step} of a run that went on to "
            f"{newest.name.removeprefix('step-').lstrip('0')} ({newest}); resuming from it would drop that "
            f"later state: pass --rewind to move it aside into {str(_aside_dir(run_dir))!r}, or resume "
            f"the newest with --resume {run_dir}"
        )
    if rewind and not later:
        raise GRPOPartsError(
            f"--rewind: {str(ckpt.folder)!r} (step {ckpt.step}) is the newest checkpoint of {str(run_dir)!r}; "
            "there is nothing later to move aside (resume without --rewind)"
        )


def _aside_dir(run_dir: Path) -> Path:
    k = 1
    while (run_dir / f"{PREFIX}{k}").exists() or (run_dir / f".{PREFIX}{k}.tmp").exists():
        k += 1
    return run_dir / f"{PREFIX}{k}"


def move_aside(run_dir: Path, step: int) -> Path:
    """Move the state after checkpoint ``step`` into a new ``rewound-K/`` (see the module docstring);
    point ``checkpoints/last`` at ``step``. Copies first (into a temporary folder renamed when whole),
    then moves, so that a kill at any moment leaves every file in the run or in ``rewound-K/``."""
    later = later_checkpoints(run_dir, step)
    final = _aside_dir(run_dir)
    tmp = final.with_name(f".{final.name}.tmp")
    tmp.mkdir()
    for p in sorted(run_dir.iterdir()):
        if p.name in ("checkpoints", *MOVED) or p.name.startswith((PREFIX, f".{PREFIX}")):
            continue
        if p.is_dir():
            shutil.copytree(p, tmp / p.name, symlinks=True)
        elif p.is_file():
            shutil.copy2(p, tmp / p.name)
    (tmp / "checkpoints").mkdir()
    last = run_dir / "checkpoints" / LAST
    if last.is_file():
        shutil.copy2(last, tmp / "checkpoints" / LAST)
    fsync_path(tmp)
    os.replace(tmp, final)
    moved = []
    for p in later:
        os.replace(p, final / "checkpoints" / p.name)
        moved.append(f"checkpoints/{p.name}")
    for name in MOVED:
        if (run_dir / name).exists():
            os.replace(run_dir / name, final / name)
            moved.append(f"{name}/")
    atomic_write_text(last, step_name(step) + "\n")
    log.info(
        "rewind: moved the state after step %d (%s) aside to %s, with a copy of the run's other files",
        step, ", ".join(moved), final,
    )  # fmt: skip
    return final
