"""Prompt skipping behind verl: trainer mode ``grpo_parts_sync`` draws each step's prompts past the shared
:class:`grpo_parts.skip.stage.SkipStage` in ``_next_train_batch``; only kept ones are submitted, and the
filter step multiplies each kept row's weight into its advantage (:func:`~.kv_filter.filter_kv_batch`). The
history is saved beside verl's checkpoint. docs/adapters/verl.md, "Prompt skipping"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from grpo_parts.counters import framework_keys
from grpo_parts.errors import GRPOPartsError
from grpo_parts.skip.protocol import PromptId, PromptSkipper, prompt_id
from grpo_parts.skip.stage import SkipStage

logger = logging.getLogger(__name__)

#: the skipper's history beside verl's checkpoint, in each ``global_step_*`` folder
STATE_FILE = "grpo_parts_prompt_skip.pt"
#: one prompt of verl's dataloader: (its one-row TensorDict, its prompt id, its uid)
Row = tuple[Any, PromptId, str]


def _plain(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


def row_prompt_id(raw_prompt: Any) -> PromptId:
    """The id of a verl prompt (its chat messages; numpy arrays as lists): the one rule every door
    shares (:func:`grpo_parts.skip.protocol.prompt_id`)."""
    value = _plain(raw_prompt)
    return prompt_id(value if isinstance(value, str) else [_plain(m) for m in value])


class PromptRows(Iterator[Row]):
    """verl's training prompts one at a time: ``fetch()`` is the trainer's ``_fetch_one_gen_batch``
    (one dataloader fetch with fresh uids; it starts a new epoch by itself)."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self.fetch = fetch
        self.buffer: list[Row] = []

    def __next__(self) -> Row:
        if not self.buffer:
            from verl.utils import tensordict_utils as tu

            batch = self.fetch()
            prompts, uids = list(batch["raw_prompt"]), [str(u) for u in batch["uid"]]
            self.buffer = [
                (tu.index_select_tensor_dict(batch, [i]), row_prompt_id(prompts[i]), uids[i])
                for i in range(len(uids))
            ]
            self.buffer.reverse()
        return self.buffer.pop()


class VerlSkipStage(SkipStage[Row]):
    """The skipping stage of one verl run: :meth:`take` a step's prompts (a TensorDict to submit),
    then :meth:`row_weights` / :meth:`observe_rows` by uid, :meth:`step_metrics`."""

    def __init__(self, skipper: PromptSkipper, group_size: int, fetch: Callable[[], Any]) -> None:
        super().__init__(skipper, group_size, PromptRows(fetch), key=lambda row: row[1], door="verl")
        self.uid_ids: dict[str, PromptId] = {}  # the rolled-out prompts of the current step
        self.mean_length = 0.0  # of the last observed rows: the tokens a skip saves without history

    def take(self, num_prompts: int) -> Any:
        """The next step's ``num_prompts`` kept prompts, concatenated as verl submits them."""
        from verl.utils import tensordict_utils as tu

        rows = self.take_round(num_prompts)
        if not rows:
            raise GRPOPartsError("prompt skipping: verl's dataloader gave no prompt")
        self.uid_ids = {uid: pid for _, pid, uid in rows}
        return rows[0][0] if len(rows) == 1 else tu.concat_tensordict([r[0] for r in rows])

    def _ids(self, uids: Sequence[Any]) -> list[PromptId]:
        missing = [u for u in uids if str(u) not in self.uid_ids]
        if missing:
            raise GRPOPartsError(
                f"prompt skipping: sampled row of uid {missing[0]!r} was not among this step's submitted "
                "prompts; expected the sync trainer (one step's prompts per sample)"
            )
        return [self.uid_ids[str(u)] for u in uids]

    def row_weights(self, uids: Sequence[Any]) -> torch.Tensor:
        """``[rows]`` float64: each row's ``1 / p x rolled-out / drawn``, by its uid."""
        return self.weights_for(self._ids(uids))

    def observe_rows(self, uids: Sequence[Any], rewards: torch.Tensor, lengths: torch.Tensor) -> None:
        """Tell the skipper every rolled-out group of the step (rows in any order)."""
        ids = self._ids(uids)
        groups = {pid: g for g, pid in enumerate(dict.fromkeys(ids))}
        index = torch.tensor([groups[pid] for pid in ids], dtype=torch.long)
        self.observe(ids, rewards.detach().double().cpu(), index, lengths.detach().cpu())
        self.mean_length = float(lengths.float().mean()) if lengths.numel() else 0.0

    def step_metrics(self) -> dict[str, float]:
        """``parts/prompt_skip/*`` of the step (``prompts_skipped``, ``prompts_drawn``, ...)."""
        return framework_keys("prompt_skip", self.metrics(fallback_length=self.mean_length))

    def save(self, folder: str) -> None:
        torch.save(self.state_dict(), os.path.join(folder, STATE_FILE))

    def load(self, folder: str) -> bool:
        """Load the history saved in ``folder``; False (logged) when there is none."""
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            logger.warning("prompt skipping: no %s in %s; the skip history starts empty", STATE_FILE, folder)
            return False
        self.load_state_dict(torch.load(path, weights_only=False))
        return True
