"""The built-in vision task: how many squares are in the image?

Each problem is one synthetic ``image_size``-pixel image (black, with 1 to ``max_shapes`` coloured
squares, each filling one ``CELL``-pixel cell of a grid) and the question "how many"; the answer is
the count, graded by the completion's first word (exact match). A cell is one merged vision token of the warm start's tower, so
the image is ``(image_size / CELL)**2`` tokens of a prompt that repeats per completion unless the
attention encodes it once per group. Problems come from ``(seed, position)`` alone (the stream
resumes anywhere); a fixed ``eval_percent`` of the layouts (by a hash) is held out, never trained on.
"""

from __future__ import annotations

import random
import zlib
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import GRPOPartsError
from .data import Problem

#: pixels per side of a cell: one merged 2 x 2 block of 2-pixel patches (the warm start's tower)
CELL = 4
COLOURS = ((255, 64, 64), (64, 255, 64), (64, 64, 255))
QUESTION = "how many"


class VisionConfig(BaseModel):
    """The built-in image task. ``eval_percent`` of all layouts are held out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["vision"] = "vision"
    max_shapes: int = Field(4, ge=1, le=9, description="each image holds 1 to this many squares (the answer)")
    image_size: int = Field(
        16, ge=8, le=64, description=f"image side in pixels, a multiple of {CELL} (one square per cell)"
    )
    eval_percent: int = Field(10, ge=1, le=50)
    num_eval: int = Field(100, ge=1, le=10_000)

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.image_size % CELL:
            raise ValueError(f"image_size: expected a multiple of {CELL}, got {self.image_size}")
        if self.max_shapes > (self.image_size // CELL) ** 2:
            raise ValueError(
                f"max_shapes: expected <= {(self.image_size // CELL) ** 2} (the cells of a "
                f"{self.image_size}-pixel image), got {self.max_shapes}"
            )
        return self

    @property
    def image_tokens(self) -> int:
        """Merged vision tokens per image (one per cell)."""
        return (self.image_size // CELL) ** 2


def draw_image(cells: list[int], colours: list[int], size: int) -> np.ndarray:
    """``[size, size, 3]`` uint8: black, with cell ``cells[i]`` (row-major) filled in ``COLOURS[colours[i]]``."""
    image = np.zeros((size, size, 3), np.uint8)
    grid = size // CELL
    for cell, colour in zip(cells, colours):
        r, c = divmod(cell, grid)
        image[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL] = COLOURS[colour]
    return image


def question_messages() -> list[dict[str, Any]]:
    """The chat prompt of every problem: the image, then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


class VisionTask:
    """Counting squares. ``processor``: the policy's processor, whose chat template renders the
    prompt (the image's placeholder as the model's family writes it)."""

    name = "vision"
    grader_name = "first word, exact match"

    def __init__(self, config: VisionConfig, processor: Any, seed: int = 0):
        self.config = config
        self.seed = seed
        self.prompt = processor.apply_chat_template(
            question_messages(), add_generation_prompt=True, tokenize=False
        )

    def _layout(self, rng: random.Random) -> tuple[list[int], list[int]]:
        n = rng.randint(1, self.config.max_shapes)
        cells = sorted(rng.sample(range(self.config.image_tokens), n))
        return cells, [rng.randrange(len(COLOURS)) for _ in cells]

    def _held_out(self, layout: tuple[list[int], list[int]]) -> bool:
        return zlib.crc32(repr(layout).encode()) % 100 < self.config.eval_percent

    def problem(self, cells: list[int], colours: list[int]) -> Problem:
        """The problem whose image has squares in ``cells`` coloured ``colours``."""
        image = draw_image(cells, colours, self.config.image_size)
        return Problem(self.prompt, str(len(cells)), messages=question_messages(), images=(image,))

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"train:{self.seed}:{index}")
        while self._held_out(layout := self._layout(rng)):
            pass
        return self.problem(*layout)

    def eval_problems(self) -> list[Problem]:
        """The held-out set: the same layouts for every seed."""
        rng, seen, misses = random.Random("eval"), set(), 0
        out: list[Problem] = []
        while len(out) < self.config.num_eval:
            layout = self._layout(rng)
            if self._held_out(layout) and repr(layout) not in seen:
                seen.add(repr(layout))
                out.append(self.problem(*layout))
                misses = 0
            elif (misses := misses + 1) >= 100_000:
                raise GRPOPartsError(
                    f"task.num_eval: got {self.config.num_eval}, but these task settings hold only "
                    f"{len(out)} held-out images; expected <= {len(out)} (or a larger task.image_size)"
                )
        return out

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if completion.split()[:1] == [problem.answer] else 0.0
