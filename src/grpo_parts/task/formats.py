"""Reading ``--data``: JSONL, parquet or a ``datasets`` folder, in the formats of the field
(``prompt_answer``, ``messages``, ``gsm8k``, ``math``; ``auto`` picks one from the first row's
columns). Each format's columns and gold answer: docs/training.md, "Data formats". parquet and
``save_to_disk`` folders need the ``[data]`` extra, imported only when such data is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError, install_hint
from .graders import after_delimiter, final_answer, last_boxed
from .images import IMAGE_COLUMNS, image_parts, row_images

#: how to install what parquet / datasets folders need, from a checkout of this repository
DATA_INSTALL = install_hint("data")

#: format -> (prompt column, answer column)
FORMAT_KEYS = {
    "prompt_answer": ("prompt", "answer"),
    "messages": ("messages", "answer"),
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
}


@dataclass
class Record:
    """One problem as read: the prompt (text, or chat messages still to render), the gold final
    answer, every column of its row (passed to reward functions) and its images (:mod:`.images`)."""

    prompt: str | list[dict[str, Any]]
    answer: str
    columns: dict[str, Any]
    where: str
    images: list[Any] = field(default_factory=list)


def _need(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise GRPOPartsError(
            f"data: reading {what} needs the {module.split('.')[0]} package; expected it installed "
            f"({DATA_INSTALL})"
        ) from None


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a JSONL file, a parquet file or a ``save_to_disk`` folder."""
    if path.is_dir():
        if not any((path / n).is_file() for n in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise GRPOPartsError(
                f"data: {str(path)!r} is a folder but not a datasets save_to_disk folder; expected a "
                ".jsonl or .parquet file, or a folder written by Dataset.save_to_disk"
            )
        datasets = _need("datasets", "a save_to_disk folder")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise GRPOPartsError(
                    f"data: {str(path)!r} holds the splits {sorted(ds)}; expected a 'train' split "
                    "(or save the split you want with Dataset.save_to_disk)"
                )
            ds = ds["train"]
        return [(f"{path} row {i + 1}", r) for i, r in enumerate(ds.to_list())]
    if not path.is_file():
        raise GRPOPartsError(f"data: no such file {str(path)!r}")
    if path.suffix == ".parquet":
        pq = _need("pyarrow.parquet", "parquet")
        try:
            rows = pq.read_table(str(path)).to_pylist()
        except Exception as e:  # pyarrow's errors have no common base worth naming
            raise GRPOPartsError(f"data: {str(path)!r} is not a readable parquet file ({e})") from None
        return [(f"{path} row {i + 1}", r) for i, r in enumerate(rows)]
    return _jsonl_rows(path)


def _jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise GRPOPartsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise GRPOPartsError(
                    f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(rec).__name__}"
                )
            out.append((where, rec))
    return out


def detect_format(row: dict[str, Any], fmt: str, prompt_key: str | None) -> str:
    """The data format of ``row`` (``fmt`` unless it is ``auto``)."""
    if fmt != "auto":
        return fmt
    if prompt_key is not None:
        return "messages" if isinstance(row.get(prompt_key), list) else "prompt_answer"
    for name in ("messages", "prompt_answer", "gsm8k", "math"):
        if FORMAT_KEYS[name][0] in row:
            return name
    raise GRPOPartsError(
        f"data: the first record has the columns {sorted(row)}; expected prompt/answer, messages, "
        "question/answer (GSM8K) or problem/solution (MATH), or task.prompt_key / task.answer_key naming yours"
    )


def _is_part(p: Any) -> bool:
    return isinstance(p, dict) and (p.get("type") == "image" or isinstance(p.get("text"), str))


def _is_message(m: Any) -> bool:
    content = m.get("content") if isinstance(m, dict) else None
    parts = isinstance(content, list) and all(map(_is_part, content))  # text and image parts
    return isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(content, str) or parts)


def _messages(where: str, key: str, value: Any) -> list[dict[str, Any]]:
    if not (isinstance(value, list) and value and all(map(_is_message, value))):
        raise GRPOPartsError(
            f"{where}: {key!r} must be a non-empty list of {{'role': str, 'content': str or parts}} messages, "
            f"got {value!r:.80}"
        )
    return [dict(m) for m in value]


def to_record(
    where: str,
    row: dict[str, Any],
    fmt: str,
    prompt_key: str | None,
    answer_key: str | None,
    base: Path = Path("."),
) -> Record:
    """One row in format ``fmt`` as a :class:`Record` (image paths relative to ``base``); a bad row
    raises an error naming ``where``."""
    pkey, akey = prompt_key or FORMAT_KEYS[fmt][0], answer_key or FORMAT_KEYS[fmt][1]
    if pkey not in row or (akey not in row and fmt != "messages"):
        missing = [k for k in (pkey, akey) if k not in row]
        raise GRPOPartsError(
            f"{where}: missing key(s) {missing}; expected {pkey!r} and {akey!r} ({fmt} format), got {sorted(row)}"
        )
    prompt: str | list[dict[str, Any]] = row[pkey]
    answer = row.get(akey)
    if isinstance(prompt, list) or fmt == "messages":
        prompt = _messages(where, pkey, prompt)
        if answer is None:
            if (
                prompt[-1]["role"] != "assistant"
                or len(prompt) < 2
                or not isinstance(prompt[-1]["content"], str)
            ):
                raise GRPOPartsError(
                    f"{where}: no {akey!r} and no final assistant message to take the answer from; expected one of them"
                )
            answer, prompt = final_answer(prompt[-1]["content"]), prompt[:-1]
    elif not isinstance(prompt, str) or not prompt.strip():
        raise GRPOPartsError(f"{where}: {pkey!r} must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise GRPOPartsError(f"{where}: {akey!r} must be a string or a number, got {type(answer).__name__}")
    answer = str(answer)
    if fmt == "gsm8k":
        final = after_delimiter(answer, "####")
        if not final:
            raise GRPOPartsError(
                f"{where}: {akey!r} has no final answer after '####' (GSM8K format), got {answer!r:.80}; expected "
                "'... #### 42' (or task.format: prompt_answer)"
            )
        answer = final
    elif fmt == "math":
        boxed = last_boxed(answer)
        if not boxed:
            raise GRPOPartsError(
                f"{where}: {akey!r} has no \\boxed{{...}} final answer (MATH format), got {answer!r:.80}; "
                "expected '... \\boxed{42}' (or task.format: prompt_answer)"
            )
        answer = boxed
    return Record(prompt, answer.strip(), row, where, _images(where, row, prompt, base))


def _images(where: str, row: dict[str, Any], prompt: str | list[dict[str, Any]], base: Path) -> list[Any]:
    """The row's images, each with its place in the chat prompt (an image part per image, in order)."""
    if not any(row.get(k) is not None for k in IMAGE_COLUMNS):
        return []
    images = row_images(row, base, where)
    parts = image_parts(prompt) if isinstance(prompt, list) else 0
    if parts != len(images):
        raise GRPOPartsError(
            f"{where}: {len(images)} image(s) but {parts} {{'type': 'image'}} part(s) in the chat prompt; "
            "expected one image part per image, in order (TRL's conversational image format)"
        )
    return images


def load_records(
    path: Path | str, fmt: str = "auto", prompt_key: str | None = None, answer_key: str | None = None
) -> tuple[list[Record], str]:
    """Every record of ``path`` and the format they were read in."""
    p = Path(path)
    rows = read_rows(p)
    if not rows:
        raise GRPOPartsError(f"data: {str(p)!r} has no records")
    fmt = detect_format(rows[0][1], fmt, prompt_key)
    base = p if p.is_dir() else p.parent
    return [to_record(w, r, fmt, prompt_key, answer_key, base) for w, r in rows], fmt
