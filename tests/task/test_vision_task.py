"""The built-in vision task: images that hold what the answer says, a held-out set never trained on,
prompts whose image placeholders the processor expands once per prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from grpo_parts.compat import transformers_version
from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.data import encode_problems
from grpo_parts.task.vision import CELL, VisionConfig, VisionTask, draw_image
from grpo_parts.tiny_vision import tiny_processor, tiny_vlm


@pytest.fixture(scope="module")
def processor() -> object:
    if transformers_version() < (5, 0):  # the task is refused there (tests/train/test_vision_run.py)
        pytest.skip("the offline Qwen2-VL processor needs transformers >= 5 (4.x wants a video processor)")
    return tiny_processor(tiny_vlm("qwen2_vl", vocab_size=64), max_image_tokens=VisionConfig().image_tokens)


def _squares(image: np.ndarray) -> int:
    cells = image.reshape(image.shape[0] // CELL, CELL, image.shape[1] // CELL, CELL, 3)
    return int((cells.max(axis=(1, 3, 4)) > 0).sum())


def test_each_image_holds_its_answer(processor: object) -> None:
    task = VisionTask(VisionConfig(max_shapes=5, image_size=20), processor, seed=3)
    for i in range(50):
        p = task.train_problem(i)
        (image,) = p.images
        assert image.shape == (20, 20, 3) and image.dtype == np.uint8
        assert _squares(image) == int(p.answer) and 1 <= int(p.answer) <= 5
    assert draw_image([0, 5], [0, 2], 16)[4:8, 4:8].tolist() == [[[64, 64, 255]] * 4] * 4


def test_the_stream_resumes_and_never_trains_on_a_held_out_image(processor: object) -> None:
    task = VisionTask(VisionConfig(num_eval=40), processor, seed=1)
    again = VisionTask(VisionConfig(num_eval=40), processor, seed=1)
    assert all(
        np.array_equal(task.train_problem(i).images[0], again.train_problem(i).images[0]) for i in (0, 7, 99)
    )
    held = {e.images[0].tobytes() for e in task.eval_problems()}
    assert len(held) == 40
    assert not held & {task.train_problem(i).images[0].tobytes() for i in range(2000)}


def test_too_many_held_out_images_is_one_line(processor: object) -> None:
    task = VisionTask(VisionConfig(max_shapes=1, image_size=8, num_eval=100), processor)
    with pytest.raises(GRPOPartsError, match=r"^task.num_eval: got 100, but these task settings hold only"):
        task.eval_problems()


@pytest.mark.parametrize(
    ("field", "value", "fragment"), [("image_size", 18, "multiple of 4"), ("max_shapes", 5, "expected <= 4")]
)
def test_bad_settings_name_the_field(field: str, value: int, fragment: str) -> None:
    kw = {"image_size": 8} if field == "max_shapes" else {}
    with pytest.raises(ValidationError, match=fragment):
        VisionConfig(**{**kw, field: value})


def test_reward_is_an_exact_answer(processor: object) -> None:
    task = VisionTask(VisionConfig(), processor)
    p = task.train_problem(0)
    assert task.reward(f" {p.answer} ", p) == 1.0
    assert task.reward(p.answer + "1", p) == 0.0


def test_prompts_carry_their_image_once(processor: object) -> None:
    """The processor expands each prompt's placeholder to its image's tokens; the batch holds each
    prompt's pixels once (not per completion), in the order of the prompts."""
    config = VisionConfig(image_size=16)
    task = VisionTask(config, processor)
    problems = [task.train_problem(i) for i in range(3)]
    batch = encode_problems(processor, problems)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")  # type: ignore[attr-defined]
    assert ((batch.input_ids == image_token).sum(-1) == config.image_tokens).all()
    assert batch.vision is not None and len(batch.vision.per_prompt) == 3
    for images in batch.vision.per_prompt:
        assert images["image_grid_thw"].tolist() == [[1, 8, 8]]  # 2-pixel patches, merged 2 x 2: 16 tokens
    assert torch.equal(batch.attention_mask[:, -1], torch.ones(3, dtype=batch.attention_mask.dtype))
