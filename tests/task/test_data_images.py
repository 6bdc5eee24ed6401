"""``--data`` records with images: every usual way a row holds an image loads the same pixels, each
image has its place in the chat prompt, and a bad entry is one line naming the row."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from grpo_parts.errors import GRPOPartsError
from grpo_parts.task.formats import load_records
from grpo_parts.task.images import load_image

PIXELS = (np.arange(8 * 8 * 3) % 251).astype(np.uint8).reshape(8, 8, 3)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format="PNG")
    return buf.getvalue()


def _prompt(n: int) -> list[dict[str, object]]:
    return [{"role": "user", "content": [*[{"type": "image"}] * n, {"type": "text", "text": "how many"}]}]


def test_every_usual_entry_loads_the_same_pixels(tmp_path: Path) -> None:
    from PIL import Image

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    for entry in ("img/a.png", str(tmp_path / "img" / "a.png"), uri, {"bytes": _png(), "path": None},
                  {"bytes": None, "path": "img/a.png"}, Image.fromarray(PIXELS)):  # fmt: skip
        assert np.array_equal(np.asarray(load_image(entry, tmp_path, "row 1")), PIXELS), entry


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("missing.png", "row 1: image 'missing.png': no such file"),
        ("data:image/png,abc", "expected 'data:image/...;base64,...'"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ({"bytes": b"not a png", "path": None}, "could not be read"),
        (3, "image entry of type int"),
    ],
)
def test_a_bad_entry_is_one_line_naming_the_row(tmp_path: Path, entry: object, fragment: str) -> None:
    with pytest.raises(GRPOPartsError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        load_image(entry, tmp_path, "row 1")


def test_records_carry_their_images_in_order(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png())
    rows = [
        {"prompt": _prompt(1), "image": "a.png", "answer": "1"},
        {"prompt": _prompt(2), "images": ["a.png", "a.png"], "answer": "2"},
        {"prompt": "text only", "answer": "0"},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = load_records(data)
    assert [len(r.images) for r in records] == [1, 2, 0]


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"prompt": _prompt(1), "images": ["a.png", "a.png"]}, "2 image(s) but 1 {'type': 'image'} part(s)"),
        ({"prompt": "how many", "image": "a.png"}, "1 image(s) but 0 {'type': 'image'} part(s)"),
        ({"prompt": _prompt(1), "images": "a.png"}, "'images' must be a list"),
    ],
)
def test_images_without_their_place_are_refused(
    tmp_path: Path, row: dict[str, object], fragment: str
) -> None:
    (tmp_path / "a.png").write_bytes(_png())
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**row, "answer": "1"}) + "\n")
    with pytest.raises(GRPOPartsError) as e:
        load_records(data)
    assert str(e.value).startswith(f"{data}:1: ") and fragment in str(e.value), str(e.value)
