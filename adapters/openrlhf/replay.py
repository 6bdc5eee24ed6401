"""Training micro-batches that keep a prompt's completions together (for shared-prefix attention).
OpenRLHF's ``DataLoader`` shuffles single samples into micro-batches, so a prompt's completions rarely
share one; :class:`GroupedReplayBuffer` makes each item a whole micro-batch cut in arrival order
(prompt-major), so the shuffle permutes micro-batches: same samples and loss normalisation. Not for
``--train.dynamic_batch_enable``. docs/adapters/openrlhf.md, "AttentionBackend"."""

from __future__ import annotations

from typing import Any

from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

from grpo_parts.errors import GRPOPartsError


class GroupedReplayBuffer(NaiveReplayBuffer):
    """Items are micro-batches of ``micro_batch_size`` consecutive samples; ``sample_batch_size`` is 1
    so OpenRLHF's DataLoader hands one micro-batch at a time to ``collate_fn``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group()

    @classmethod
    def replacing(cls, buffer: NaiveReplayBuffer) -> GroupedReplayBuffer:
        """A grouped buffer with ``buffer``'s settings (and items), built without its constructor's
        CUDA calls."""
        new = cls.__new__(cls)
        new.__dict__.update(buffer.__dict__)
        new._group()
        return new

    def _group(self) -> None:
        if self.dynamic_batch:
            raise GRPOPartsError(
                "GroupedReplayBuffer: --train.dynamic_batch_enable builds its own micro-batches"
            )
        self.micro_batch_size: int = int(self.sample_batch_size)  # type: ignore[has-type]
        self.sample_batch_size = 1

    def __len__(self) -> int:
        return len(self.items) // self.micro_batch_size  # drop_last, as OpenRLHF's loader does

    def __getitem__(self, idx: int) -> list[Experience]:  # type: ignore[override]
        return self.items[idx * self.micro_batch_size : (idx + 1) * self.micro_batch_size]

    def collate_fn(self, batch: list[list[Experience]]) -> Experience:  # type: ignore[override]
        return make_experience_batch([one for micro in batch for one in micro], self.packing_samples)
