"""A processor's flat image outputs per prompt and per row (``VisionInputs.from_processor`` /
``per_row``), cut to kept rows (``select_rows``) and grouped with the prompt tokens
(``doors.vision.image_groups``): each row keeps its own images whatever their counts and sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_parts.doors.vision import image_groups
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.apply import select_rows
from grpo_parts.types import VisionInputs


def _qwen_rows(counts: list[int], sizes: list[int]) -> tuple[dict, list[list[torch.Tensor]]]:
    """A Qwen-VL-like flat batch: row r holds counts[r] images of 1 x 2 x sizes[k] patches (values
    name the row and image), plus each row's own patch blocks to compare with."""
    grids, pixels, own = [], [], []
    k = 0
    for r, n in enumerate(counts):
        mine = []
        for i in range(n):
            w = sizes[k % len(sizes)]
            k += 1
            block = torch.full((2 * w, 3), float(100 * r + i))
            grids.append([1, 2, w])
            pixels.append(block)
            mine.append(block)
        own.append(mine)
    fields = {
        "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, 3),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        "num_images": counts,
        "mm_token_type_ids": torch.zeros(len(counts), 4),
    }
    return fields, own


@settings(derandomize=True, deadline=None, max_examples=30)
@given(
    counts=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    data=st.data(),
)
def test_each_kept_row_keeps_its_own_images(counts: list[int], sizes: list[int], data) -> None:
    fields, own = _qwen_rows(counts, sizes)
    n = len(counts)
    rows = VisionInputs.per_row(fields, n)
    assert rows is not None
    for r in range(n):
        got = rows.per_prompt[r]
        if not own[r]:
            assert got == {}
            continue
        torch.testing.assert_close(got["pixel_values"], torch.cat(own[r]))
        assert got["image_grid_thw"].shape[0] == counts[r]
    kept = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    out = select_rows(fields, torch.tensor(kept), n)
    assert out["num_images"] == [counts[r] for r in kept]
    assert list(out) == list(fields)  # the batch's key order (TRL splits by its first tensor)
    want = [b for r in kept for b in own[r]]
    if want:
        torch.testing.assert_close(out["pixel_values"], torch.cat(want))
        assert out["image_grid_thw"].shape[0] == sum(counts[r] for r in kept)
    else:
        assert out["pixel_values"] is None and out["image_grid_thw"] is None
    assert out["mm_token_type_ids"].shape[0] == len(kept)


def test_llava_layout_one_pixel_row_per_image() -> None:
    pixels = torch.arange(3.0)[:, None, None, None].expand(3, 3, 2, 2)
    rows = VisionInputs.per_row({"pixel_values": pixels, "num_images": [2, 0, 1]}, 3)
    assert rows is not None
    assert rows.per_prompt[0]["pixel_values"].shape[0] == 2 and rows.per_prompt[1] == {}
    assert float(rows.per_prompt[2]["pixel_values"].max()) == 2.0
    assert VisionInputs.per_row({"input_ids": torch.zeros(2, 3)}, 2) is None  # text only


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"pixel_values": torch.zeros(5, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}, "expected 4 rows"),
        (
            {"pixel_values": torch.zeros(1, 3), "spatial_shapes": torch.zeros(1, 2)},
            "spatial_shapes: an image layout grpo_parts does not split",
        ),
        (
            {"pixel_values": torch.zeros(2, 3), "num_images": [1, 1, 1]},
            "num_images: expected one count per row",
        ),
    ],
)
def test_layouts_it_cannot_split_are_refused_in_one_line(fields: dict, match: str) -> None:
    with pytest.raises(GRPOPartsError, match=match):
        VisionInputs.per_row(fields, 1 if "num_images" not in fields else 2)


def test_rows_with_one_text_and_different_images_are_different_groups() -> None:
    a, b = {"pixel_values": torch.zeros(4, 3)}, {"pixel_values": torch.ones(4, 3)}
    rows = VisionInputs((a, a, b, b, {}, a))
    text = torch.tensor([0, 0, 0, 0, 1, 2])  # rows 0-3 one text; row 5 another text, row 0's image
    group, vision = image_groups(text, rows)
    assert group.tolist() == [0, 0, 1, 1, 2, 3]
    assert [float(v["pixel_values"].sum()) if v else None for v in vision.per_prompt] == [
        0.0,
        12.0,
        None,
        0.0,
    ]


def test_images_per_row_reads_each_rows_share_off_its_image_tokens() -> None:
    """OpenRLHF merges images flat: row r's images are the next ones whose grids fill its image
    tokens; a batch whose tokens and images do not add up is refused in one line."""
    from grpo_parts.doors.vision import images_per_row
    from grpo_parts.tiny_vision import tiny_vlm

    model = tiny_vlm("qwen2_vl")
    img = model.config.image_token_id
    ids = torch.tensor(
        [[5, img, img, 6, img, img, img, img], [0, 0, 0, 0, 5, 6, 7, 8], [0, 0, 0, 5, img, img, 9, 9]]
    )
    mask = (ids != 0).long()
    grids = torch.tensor([[1, 2, 4], [1, 4, 4], [1, 2, 4]])  # 2, 4, 2 tokens after the 2x2 merge
    fields = {"pixel_values": torch.zeros(int(grids.prod(-1).sum()), 3), "image_grid_thw": grids}
    assert images_per_row(model, ids, mask, fields) == [2, 0, 1]
    with pytest.raises(GRPOPartsError, match="row 2 holds 2 image tokens, its images in order make 0"):
        images_per_row(model, ids, mask, {**fields, "image_grid_thw": grids[[0, 0, 2]]})
