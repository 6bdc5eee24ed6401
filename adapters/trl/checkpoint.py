"""grpo_parts' own state in TRL's checkpoints (the prompt skipper's history, a random filter's generator),
so a resumed run skips and draws as the uninterrupted one would have: a ``TrainerCallback`` writes
:data:`STATE_FILE` into each ``checkpoint-<step>`` folder; ``train`` reads it back before TRL's resume."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOTrainer

from grpo_parts.errors import GRPOPartsError

logger = logging.getLogger(__name__)

#: the file beside TRL's own in each ``checkpoint-<step>`` folder
STATE_FILE = "grpo_parts_state.pt"
#: trainer attribute -> key in :data:`STATE_FILE`
PARTS_WITH_STATE = {"gp_skipper": "prompt_skip", "gp_filter": "filter"}


def parts_state(trainer: Any) -> dict[str, Any]:
    """The state of every part of ``trainer`` that has one (``state_dict()``)."""
    out = {}
    for attr, key in PARTS_WITH_STATE.items():
        part = getattr(trainer, attr, None)
        if part is not None and callable(getattr(part, "state_dict", None)):
            out[key] = part.state_dict()
    return out


def resolve_checkpoint(trainer: Any, resume_from_checkpoint: str | bool | None) -> Path | None:
    """The folder TRL resumes from: a path as given, ``True``: the last ``checkpoint-*`` in
    ``output_dir`` (None when there is none: TRL then refuses with its own message)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(trainer.args.output_dir)
        return None if last is None else Path(last)
    return Path(resume_from_checkpoint)


def load_parts_state(trainer: Any, folder: Path | None) -> list[str]:
    """Load :data:`STATE_FILE` from ``folder`` into ``trainer``'s parts; the keys loaded. A checkpoint
    written without it (an older run, or parts without state) loads nothing, said once."""
    if folder is None:
        return []
    path = folder / STATE_FILE
    if not path.is_file():
        if parts_state(trainer):
            logger.warning("grpo_parts: %s has no %s; the parts start with fresh state", folder, STATE_FILE)
        return []
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one line naming the file
        raise GRPOPartsError(
            f"{path}: expected a grpo_parts state file, got one torch cannot read ({e})"
        ) from None
    loaded = []
    for attr, key in PARTS_WITH_STATE.items():
        part = getattr(trainer, attr, None)
        if key in state and part is not None and callable(getattr(part, "load_state_dict", None)):
            part.load_state_dict(state[key])
            loaded.append(key)
    return loaded


class PartsStateCallback(TrainerCallback):
    """Writes :data:`STATE_FILE` into each checkpoint folder (process 0 only)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        saved = parts_state(self.trainer)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if saved and folder.is_dir():
            torch.save(saved, folder / STATE_FILE)


class StateSeam(GRPOTrainer):
    """``train(resume_from_checkpoint=...)``: the parts' state is read back before TRL's own resume,
    and every later checkpoint gets it (:class:`PartsStateCallback`, registered on first ``train``)."""

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if not any(isinstance(cb, PartsStateCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(PartsStateCallback(self))
        loaded = load_parts_state(self, resolve_checkpoint(self, resume_from_checkpoint))
        if loaded:
            logger.info("grpo_parts: resumed the state of %s", ", ".join(loaded))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
