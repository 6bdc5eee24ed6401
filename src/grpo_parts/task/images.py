"""Images of ``--data`` records, in the usual dataset conventions: an ``image`` column (one) or an
``images`` column (a list), each entry a file path (relative to the data file's folder), a
``data:image/...;base64,`` URI, a ``datasets`` Image value (``{"bytes": ..., "path": ...}``) or an
image object already decoded (PIL). The prompt is chat messages whose ``{"type": "image"}`` parts
say where each image goes, in order (TRL's conversational image format). docs/training.md, "Images".
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError

#: the columns that hold a row's images (``images``: a list; ``image``: one)
IMAGE_COLUMNS = ("images", "image")


def _open(data: bytes | Path, where: str, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise GRPOPartsError(
            f"{where}: image {what} could not be read ({e}); expected a PNG/JPEG image"
        ) from None


def load_image(value: Any, base: Path, where: str) -> Any:
    """One image entry of a row (see the module docstring) as an RGB PIL image."""
    if hasattr(value, "convert") and hasattr(value, "size"):  # already an image
        return value.convert("RGB")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = value["bytes"] or value["path"]
    if isinstance(value, bytes):
        return _open(value, where, "bytes")
    if isinstance(value, str) and value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise GRPOPartsError(f"{where}: image URI {head!r}: expected 'data:image/...;base64,...'")
        try:
            return _open(base64.b64decode(payload, validate=True), where, "base64")
        except ValueError:
            raise GRPOPartsError(f"{where}: image URI: not valid base64") from None
    if isinstance(value, str):
        path = (base / value) if not Path(value).is_absolute() else Path(value)
        if not path.is_file():
            raise GRPOPartsError(f"{where}: image {value!r}: no such file (looked at {str(path)!r})")
        return _open(path, where, repr(value))
    raise GRPOPartsError(
        f"{where}: image entry of type {type(value).__name__}; expected a path, a data: URI, "
        "a datasets Image value or a PIL image"
    )


def row_images(row: dict[str, Any], base: Path, where: str) -> list[Any]:
    """The images of ``row`` (its ``images`` or ``image`` column), loaded; [] when it has none."""
    key = next((k for k in IMAGE_COLUMNS if row.get(k) is not None), None)
    if key is None:
        return []
    entries = row[key] if key == "images" else [row[key]]
    if not isinstance(entries, list):
        raise GRPOPartsError(f"{where}: 'images' must be a list of images, got {type(entries).__name__}")
    return [load_image(v, base, where) for v in entries]


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many ``{"type": "image"}`` parts the chat messages hold."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )
