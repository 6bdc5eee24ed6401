"""Batch types exchanged between parts (re-exported by each part's ``protocol.py``), and the
:class:`Stateful` ability any part may declare.

Tensors follow one layout everywhere (the layout TRL and verl use at their seams):

* prompts are **left-padded**: ``prompt_ids: [N, P]`` with ``prompt_mask: [N, P]`` (1 = real token);
* completions are **right-padded**: ``completion_ids: [N, T]`` with ``completion_mask: [N, T]``
  (1 for every emitted token, EOS included, 0 after it);
* ``group_index: [N]`` (int64) maps each row to its prompt ``0 .. num_prompts - 1``. Rows of a group
  need not be adjacent (TRL shuffles them) and groups need not be equal-sized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import GRPOPartsError, check_tensor

#: processor outputs aligned with the tokens, not vision inputs (rebuilt from the token ids)
TOKEN_ALIGNED_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
#: processor outputs with one entry per image: split by images per prompt (videos are not split
#: here: build their prompts' entries yourself)
PER_IMAGE_KEYS = ("image_grid_thw", "image_sizes")
#: the processor outputs :meth:`VisionInputs.from_processor` splits
VISION_KEYS = ("pixel_values", *PER_IMAGE_KEYS)
#: image outputs of other layouts (tiles, patch masks: Idefics, LFM2-VL, InternVL, Gemma 3n), refused
UNSPLIT_IMAGE_KEYS = ("pixel_attention_mask", "spatial_shapes", "num_tiles", "image_position_ids")


def _as_tensor(value: Any) -> torch.Tensor:
    """A processor output as one tensor: a list of per-image arrays (an unbatched processor's
    ``pixel_values``) stacked, anything else as it is."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float, list)):
        return torch.stack([torch.as_tensor(v) for v in value])
    return torch.as_tensor(value)


def _image_count(inputs: Mapping[str, torch.Tensor]) -> int:
    """How many images one prompt's vision inputs hold: a per-image key's length, else one
    ``pixel_values`` row per image (LLaVA's layout)."""
    key = next((k for k in PER_IMAGE_KEYS if k in inputs), "pixel_values")
    return int(inputs[key].shape[0]) if key in inputs else 0


@dataclass(frozen=True)
class VisionInputs:
    """A processor's vision outputs, once per prompt: ``per_prompt[g]`` maps the model's keywords
    (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
    ``image_sizes``, ...) to prompt ``g``'s tensors, whose first dim runs over that prompt's images
    (or over their patches, as the Qwen VL processors lay ``pixel_values`` out); an empty mapping for
    a prompt without images. The prompt's token ids carry the placeholder tokens the processor
    expanded. Rows of a batch index it by their ``group_index``, so selecting rows keeps each with
    its own prompt's images.
    """

    per_prompt: tuple[Mapping[str, torch.Tensor], ...]

    def __post_init__(self) -> None:
        for g, inputs in enumerate(self.per_prompt):
            for key, value in inputs.items():
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    got = type(value).__name__ if not isinstance(value, torch.Tensor) else "a 0-d tensor"
                    raise GRPOPartsError(
                        f"VisionInputs.per_prompt[{g}][{key!r}]: expected a tensor with a first dim over "
                        f"the prompt's images, got {got}"
                    )

    @classmethod
    def from_processor(cls, outputs: Mapping[str, Any], images_per_prompt: list[int]) -> VisionInputs:
        """Split a processor's batched vision outputs (``pixel_values`` and the keys beside it, as
        ``processor(images=..., text=...)`` lays them out for ``len(images_per_prompt)`` prompts)
        per prompt. ``pixel_values`` runs over patches (the Qwen VL family: ``image_grid_thw`` gives
        each image's ``t*h*w``) or over images (LLaVA: one row per image); ``image_sizes`` and the
        grids run over images. :data:`TOKEN_ALIGNED_KEYS` are left out; a key laid out any other way
        is refused with one line."""
        vision = {k: v for k, v in outputs.items() if k not in TOKEN_ALIGNED_KEYS and v is not None}
        pixels = vision.pop("pixel_values", None)
        pixels = None if pixels is None else _as_tensor(pixels)
        n_images = sum(images_per_prompt)
        per_image: dict[str, list[torch.Tensor]] = {}
        for key, value in vision.items():
            t = _as_tensor(value)
            if key not in PER_IMAGE_KEYS or t.ndim == 0 or t.shape[0] != n_images:
                raise GRPOPartsError(
                    f"{key}: expected one of {list(PER_IMAGE_KEYS)} with a first dim over the "
                    f"{n_images} images, got shape {list(t.shape)} (a layout grpo_parts does not split)"
                )
            per_image[key] = list(t.split(images_per_prompt))
        if pixels is not None:
            grids = per_image.get("image_grid_thw")
            rows = [int(g.prod(-1).sum()) for g in grids] if grids is not None else images_per_prompt
            if pixels.shape[0] != sum(rows):
                what = "the images' grids" if grids is not None else "the images"
                raise GRPOPartsError(
                    f"pixel_values: expected {sum(rows)} rows ({what}), got {pixels.shape[0]}"
                )
            per_image["pixel_values"] = list(pixels.split(rows))
        return cls(
            tuple(
                {k: v[b] for k, v in per_image.items()} if n else {} for b, n in enumerate(images_per_prompt)
            )
        )

    @classmethod
    def per_row(cls, fields: Mapping[str, Any], num_rows: int) -> VisionInputs | None:
        """The images of each of ``num_rows`` rows from a framework's flat processor outputs
        (:meth:`from_processor`; ``fields["num_images"]`` per row where given, else one image per
        row), or None when ``fields`` carry no vision input."""
        other = [k for k in UNSPLIT_IMAGE_KEYS if fields.get(k) is not None]
        if other:
            raise GRPOPartsError(
                f"{other[0]}: an image layout grpo_parts does not split per row (it splits "
                f"{list(VISION_KEYS)} by num_images)"
            )
        if not any(fields.get(k) is not None for k in VISION_KEYS):
            return None
        given = fields.get("num_images")
        counts = [int(n) for n in given] if given is not None else [1] * num_rows
        if len(counts) != num_rows:
            raise GRPOPartsError(f"num_images: expected one count per row ({num_rows}), got {len(counts)}")
        return cls.from_processor({k: fields[k] for k in VISION_KEYS if fields.get(k) is not None}, counts)

    def flat(self, rows: list[int], keys: list[str]) -> dict[str, Any]:
        """Rows ``rows``' images laid out flat as a processor does (:meth:`gather`), ``keys`` each
        present (None where no kept row has one), and ``num_images`` per row."""
        out: dict[str, Any] = dict.fromkeys(keys)
        out.update(self.gather(rows))
        out["num_images"] = [_image_count(self.per_prompt[r]) for r in rows]
        return out

    def to(self, device: torch.device | str) -> VisionInputs:
        """The same images on ``device``."""
        return VisionInputs(tuple({k: v.to(device) for k, v in p.items()} for p in self.per_prompt))

    def gather(self, groups: list[int]) -> dict[str, torch.Tensor]:
        """The model keywords of prompts ``groups`` in that order (a prompt named twice brings its
        images twice): each key's tensors concatenated along their first dim; {} when none has images."""
        if groups and max(groups) >= len(self.per_prompt):
            raise GRPOPartsError(
                f"group_index: expected values < {len(self.per_prompt)} (the prompts VisionInputs "
                f"holds), got {max(groups)}"
            )
        keys = dict.fromkeys(k for g in groups for k in self.per_prompt[g])
        return {
            k: torch.cat([self.per_prompt[g][k] for g in groups if k in self.per_prompt[g]]) for k in keys
        }


@dataclass(frozen=True)
class PromptBatch:
    """``B`` prompts to roll out. ``input_ids: [B, P]`` left-padded, ``attention_mask: [B, P]``;
    ``vision``: prompt ``b``'s images at ``vision.per_prompt[b]`` (a vision-language policy), or None."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        check_tensor("PromptBatch.input_ids", self.input_ids, ndim=2, dtype="int")
        b, p = self.input_ids.shape
        check_tensor("PromptBatch.attention_mask", self.attention_mask, shape=[b, p], dtype="bool_or_int")
        lens = self.attention_mask.sum(-1)
        if bool((lens == 0).any()):
            row = int((lens == 0).nonzero()[0])
            raise GRPOPartsError(
                f"PromptBatch.attention_mask: expected >= 1 real token per prompt, row {row} has 0"
            )
        # left padding: once a row starts, it has no holes
        m = self.attention_mask.long()
        if bool((m[:, 1:] < m[:, :-1]).any()):
            raise GRPOPartsError(
                "PromptBatch.attention_mask: expected left padding (0s then 1s) in every row"
            )
        if self.vision is not None and len(self.vision.per_prompt) != self.input_ids.shape[0]:
            raise GRPOPartsError(
                f"PromptBatch.vision: expected images for {self.input_ids.shape[0]} prompts, got "
                f"{len(self.vision.per_prompt)}"
            )

    @property
    def num_prompts(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_lists(cls, prompts: list[list[int]], pad_token_id: int) -> PromptBatch:
        """Left-pad a list of token-id lists."""
        if not prompts:
            raise GRPOPartsError("prompts: expected at least one prompt, got an empty list")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise GRPOPartsError(f"prompts[{i}]: expected at least one token, got an empty prompt")
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return cls(ids, mask)


@dataclass(frozen=True)
class Rollout:
    """``N`` completions (``N = sum of group sizes``) of ``num_prompts`` prompts.

    ``logprobs: [N, T]`` are the sampling policy's log-probs of the emitted tokens, defined as
    :func:`grpo_parts.core.token_logprobs` (temperature applied, top-p/top-k not), 0 where masked.
    ``stats`` carries sampler diagnostics (e.g. ``accepted_per_verify``) as plain floats.
    """

    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T]
    logprobs: torch.Tensor  # [N, T]
    group_index: torch.Tensor  # [N]
    num_prompts: int
    stats: dict[str, float] = field(default_factory=dict)
    vision: VisionInputs | None = None  # per prompt, indexed by group_index (its rows' images)

    def __post_init__(self) -> None:
        check_tensor("Rollout.prompt_ids", self.prompt_ids, ndim=2, dtype="int")
        n, p = self.prompt_ids.shape
        check_tensor("Rollout.prompt_mask", self.prompt_mask, shape=[n, p], dtype="bool_or_int")
        check_tensor(
            "Rollout.completion_ids", self.completion_ids, shape=[n, None], dtype="int", allow_empty=True
        )
        t = self.completion_ids.shape[1]
        check_tensor(
            "Rollout.completion_mask",
            self.completion_mask,
            shape=[n, t],
            dtype="bool_or_int",
            allow_empty=True,
        )
        check_tensor("Rollout.logprobs", self.logprobs, shape=[n, t], dtype="float", allow_empty=True)
        check_tensor("Rollout.group_index", self.group_index, shape=[n], dtype="int")
        if int(self.group_index.min()) < 0 or int(self.group_index.max()) >= self.num_prompts:
            raise GRPOPartsError(
                f"Rollout.group_index: expected values in [0, {self.num_prompts}), "
                f"got range [{int(self.group_index.min())}, {int(self.group_index.max())}]"
            )
        if self.vision is not None and len(self.vision.per_prompt) != self.num_prompts:
            raise GRPOPartsError(
                f"Rollout.vision: expected images for num_prompts={self.num_prompts} prompts, got "
                f"{len(self.vision.per_prompt)}"
            )

    @property
    def num_completions(self) -> int:
        return int(self.completion_ids.shape[0])

    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.long().sum(-1)

    def compact_prompts(self) -> tuple[Rollout, torch.Tensor]:
        """``(this rollout numbering only the prompts its rows hold, 0.. in ascending order of the
        old numbers; those old numbers)``: ``group_index`` renumbered, ``vision`` with it."""
        used, new_gi = torch.unique(self.group_index, sorted=True, return_inverse=True)
        vision = None
        if self.vision is not None:
            vision = VisionInputs(tuple(self.vision.per_prompt[i] for i in used.tolist()))
        out = replace(self, group_index=new_gi.to(torch.long), num_prompts=int(used.numel()), vision=vision)
        return out, used

    def select(self, rows: torch.Tensor) -> Rollout:
        """Keep ``rows: [K]``; ``group_index`` keeps its original prompt numbering."""
        return replace(
            self,
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            logprobs=self.logprobs[rows],
            group_index=self.group_index[rows],
        )


@dataclass(frozen=True)
class ScoredBatch:
    """What a :class:`~grpo_parts.filter.protocol.CompletionFilter` sees: one row per completion.

    ``rewards: [N]``, ``advantages: [N]``, ``group_index: [N]``, optional ``completion_lengths: [N]``
    (token counts, for filters and loss renormalisation). Adapters build it from their own batches.
    """

    rewards: torch.Tensor
    advantages: torch.Tensor
    group_index: torch.Tensor
    completion_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("ScoredBatch.rewards", self.rewards, ndim=1, dtype="float", allow_empty=True)
        n = self.rewards.shape[0]
        check_tensor("ScoredBatch.advantages", self.advantages, shape=[n], dtype="float", allow_empty=True)
        check_tensor("ScoredBatch.group_index", self.group_index, shape=[n], dtype="int", allow_empty=True)
        if n and int(self.group_index.min()) < 0:
            raise GRPOPartsError(
                f"ScoredBatch.group_index: expected values >= 0, got {int(self.group_index.min())}"
            )
        if self.completion_lengths is not None:
            check_tensor(
                "ScoredBatch.completion_lengths",
                self.completion_lengths,
                shape=[n],
                dtype="int",
                allow_empty=True,
            )
        if bool(torch.isnan(self.advantages).any()):
            raise GRPOPartsError("ScoredBatch.advantages: expected finite values, got NaN")

    @property
    def size(self) -> int:
        return int(self.rewards.shape[0])


@dataclass(frozen=True)
class FilterResult:
    """``kept: [K]`` int64 row indices, ascending; ``extra_prompts_wanted``: how many more prompts
    the loop should roll out (and filter) to fill the batch to its target size (0 = none);
    ``info``: diagnostics such as ``kept_fraction``.

    ``weights: [K]`` (float, > 0), or None (all 1): a random filter's importance weights (``dppo``:
    ``1 / P(row kept)``), which need the *whole* batch's denominators (:mod:`grpo_parts.filter.apply`).
    """

    kept: torch.Tensor
    extra_prompts_wanted: int = 0
    info: dict[str, float] = field(default_factory=dict)
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("FilterResult.kept", self.kept, ndim=1, dtype=torch.long, allow_empty=True)
        if self.extra_prompts_wanted < 0:
            raise GRPOPartsError(
                f"FilterResult.extra_prompts_wanted: expected >= 0, got {self.extra_prompts_wanted}"
            )
        if self.kept.numel() > 1 and bool((self.kept[1:] <= self.kept[:-1]).any()):
            raise GRPOPartsError("FilterResult.kept: expected strictly ascending row indices")
        if self.weights is not None:
            w = self.weights
            check_tensor(
                "FilterResult.weights", w, shape=[self.kept.numel()], dtype="float", allow_empty=True
            )
            if w.numel() and not bool((torch.isfinite(w) & (w > 0)).all()):
                raise GRPOPartsError("FilterResult.weights: expected finite values > 0, got one that is not")

    @property
    def is_empty(self) -> bool:
        return self.kept.numel() == 0


@runtime_checkable
class Stateful(Protocol):
    """A part whose state a checkpoint carries (every ``DraftModel``: weights, optimizer, history;
    a sampler or filter may declare it too); the trainer saves and restores it with its own."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (tensors, numbers, lists: what ``torch.save`` writes)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...
