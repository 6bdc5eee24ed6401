"""Real data (``--data``): the task of a user's problems -- formats (:mod:`.formats`), chat
rendering with the tokenizer's template, and the grader (:mod:`.graders`: ``task.grader``, or chosen
from the data). Characters the tokenizer cannot encode are refused with their counts (or, with
``task.unknown_chars: warn``, reported once). docs/training.md, "Real use: your model, your data".
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import GRPOPartsError
from .data import Problem, text_tokenizer
from .formats import Record, load_records
from .graders import MATH_INSTALL, describe, exact_match, final_answer, make_grader, math_verify_installed
from .reasoning import INSTRUCTION

__all__ = ["DataConfig", "JsonlTask", "MATH_INSTALL", "exact_match", "final_answer"]

log = logging.getLogger("grpo_parts.train")

_ARITHMETIC_PROMPT = re.compile(r"\d+(\+\d+)+=")


class DataConfig(BaseModel):
    """How ``--data`` is read and graded (``task.*`` of a run with ``--data``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["data"] = "data"
    format: Literal["auto", "prompt_answer", "messages", "gsm8k", "math"] = Field(
        "auto", description="auto: from the first record's columns"
    )
    prompt_key: str | None = Field(None, description="the prompt column (default: the format's)")
    answer_key: str | None = Field(None, description="the answer column (default: the format's)")
    grader: Literal["auto", "exact", "after_delimiter", "boxed", "last_number", "math_verify"] = Field(
        "auto", description="auto: chosen from the data (logged)"
    )
    delimiter: str | None = Field(
        None, description="after_delimiter's delimiter (default: '####' for GSM8K data, else ';')"
    )
    unknown_chars: Literal["error", "warn"] = Field(
        "error", description="characters the tokenizer cannot encode: refuse the data, or warn once"
    )


def builtin_task_of(prompts: Sequence[str]) -> str | None:
    """The built-in task whose prompts these are (all of them), or None."""
    if prompts and all(p.startswith(INSTRUCTION) for p in prompts):
        return "reasoning"
    if prompts and all(_ARITHMETIC_PROMPT.fullmatch(p) for p in prompts):
        return "arithmetic"
    return None


def choose_grader(cfg: DataConfig, fmt: str, builtin: str | None) -> tuple[str, str, str]:
    """``(grader, delimiter, why)`` for data in format ``fmt`` (``builtin``: a built-in task's prompts)."""
    delimiter = cfg.delimiter or ("####" if fmt == "gsm8k" and builtin is None else ";")
    if cfg.grader != "auto":
        return cfg.grader, delimiter, "task.grader"
    if builtin is not None:
        return "after_delimiter", ";", f"the prompts are the built-in {builtin} task's: graded as that task"
    if fmt == "gsm8k":
        return "after_delimiter", "####", "GSM8K-style data: the answer after the last '####'"
    mv = math_verify_installed()
    fallback = "boxed" if fmt == "math" else "exact"
    if not mv:
        log.warning(
            "math-verify is not installed (%s); grading %s data by %s",
            MATH_INSTALL, fmt, fallback,
        )  # fmt: skip
    why = f"the default for {fmt} data" + ("" if mv else f" without math-verify ({MATH_INSTALL})")
    return ("math_verify" if mv else fallback), delimiter, why


def render(records: list[Record], tokenizer: Any, model: str) -> list[Problem]:
    """Problems with chat prompts rendered by the tokenizer's chat template (None: no template);
    ``tokenizer`` is a vision-language model's processor for records with images."""
    out = []
    for r in records:
        if r.images and not hasattr(tokenizer, "image_processor"):
            raise GRPOPartsError(
                f"data: {r.where} has images, but {model!r} is a text model; expected a vision-language "
                "checkpoint (--model) whose processor takes them, or records without images"
            )
        if isinstance(r.prompt, str):
            out.append(Problem(r.prompt, r.answer, r.columns))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise GRPOPartsError(
                f"data: {r.where} is chat messages, but the tokenizer of {model!r} has no chat template; "
                "expected a tokenizer with one (chat_template in tokenizer_config.json or chat_template.jinja), "
                "or prompt/answer records"
            )
        text = tokenizer.apply_chat_template(r.prompt, tokenize=False, add_generation_prompt=True)
        tok = text_tokenizer(tokenizer)  # a processor renders, its tokenizer encodes
        bos = getattr(tok, "bos_token", None)
        if bos and text.startswith(bos) and tok("").input_ids[:1] == [tok.bos_token_id]:
            text = text[len(bos) :]  # the tokenizer adds BOS itself when the prompt is encoded
        out.append(Problem(text, r.answer, r.columns, r.prompt, tuple(r.images)))
    return out


def unknown_chars(tokenizer: Any, texts: Sequence[str]) -> Counter[str]:
    """Characters of ``texts`` the tokenizer encodes as its unknown token, with their counts."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return Counter()
    text = "".join(texts)
    for special in getattr(tokenizer, "all_special_tokens", []):  # a chat template's, an image placeholder
        text = text.replace(special, "")
    counts = Counter(text)
    bad = {c for c in counts if unk in tokenizer(c, add_special_tokens=False).input_ids}
    return Counter({c: n for c, n in counts.items() if c in bad})


def check_chars(tokenizer: Any, problems: Sequence[Problem], policy: str) -> str | None:
    """Refuse (``error``) or report once (``warn``, returned as a note) unencodable characters."""
    in_prompts = unknown_chars(tokenizer, [p.prompt for p in problems])
    in_answers = unknown_chars(tokenizer, [p.answer for p in problems])
    if not in_prompts and not in_answers:
        return None
    both = in_prompts + in_answers
    shown = ", ".join(f"{c!r} x{n}" for c, n in both.most_common(8)) + (", ..." if len(both) > 8 else "")
    what = (
        f"{sum(in_prompts.values())} characters of the prompts and {sum(in_answers.values())} of the answers "
        f"({len(both)} distinct: {shown}) are not in the tokenizer's vocabulary and would be encoded as "
        f"{tokenizer.unk_token!r}"
    )
    if policy == "error":
        raise GRPOPartsError(
            f"data: {what}; expected text the tokenizer covers, or --set task.unknown_chars=warn to train anyway"
        )
    log.warning("data: %s (task.unknown_chars: warn)", what)
    return f"data: {what}"


class JsonlTask:
    """Problems from ``--data``: a seeded shuffle per epoch for training, a held-out split for eval."""

    name = "jsonl"
    format = "prompt_answer"  # the data format it was read in (from_files)

    def __init__(
        self,
        train: list[Problem],
        evals: list[Problem],
        seed: int = 0,
        checker: Callable[[str, str], bool] | None = None,
        grader_name: str = "custom",
    ):
        if not train:
            raise GRPOPartsError("data: the training split is empty (lower eval_fraction or add records)")
        self.train, self.evals, self.seed = train, evals, seed
        if checker is None:
            grader, delimiter, _ = choose_grader(DataConfig(), "prompt_answer", None)
            checker, grader_name = make_grader(grader, delimiter), describe(grader, delimiter)
        self.check, self.grader_name = checker, grader_name
        self.notes: list[str] = []
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_files(
        cls,
        data: Path,
        eval_data: Path | None = None,
        eval_fraction: float = 0.05,
        seed: int = 0,
        config: DataConfig | None = None,
        tokenizer: Any = None,
        model: str = "the model",
    ) -> JsonlTask:
        """Read, split, render (chat) and check the data; choose the grader (docs/training.md, "Graders")."""
        cfg = config or DataConfig()
        records, fmt = load_records(data, cfg.format, cfg.prompt_key, cfg.answer_key)
        if eval_data is not None:
            evals, _ = load_records(eval_data, fmt, cfg.prompt_key, cfg.answer_key)
            train = records
        else:
            idx = list(range(len(records)))
            random.Random(f"split:{seed}").shuffle(idx)
            held = set(idx[: max(1, int(round(eval_fraction * len(records))))])
            train = [r for i, r in enumerate(records) if i not in held]
            evals = [records[i] for i in sorted(held)]
        train_p, eval_p = render(train, tokenizer, model), render(evals, tokenizer, model)
        text_tok = text_tokenizer(tokenizer)
        note = None if text_tok is None else check_chars(text_tok, train_p + eval_p, cfg.unknown_chars)
        grader, delimiter, why = choose_grader(cfg, fmt, builtin_task_of([p.prompt for p in train_p]))
        task = cls(train_p, eval_p, seed, make_grader(grader, delimiter), describe(grader, delimiter))
        task.format = fmt
        task.notes = [f"grader: {task.grader_name} ({why})", *([note] if note else [])]
        return task

    def train_problem(self, index: int) -> Problem:
        epoch, i = divmod(index, len(self.train))
        if epoch not in self._orders:
            order = list(range(len(self.train)))
            random.Random(f"epoch:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # keep only the current epoch's permutation
        return self.train[self._orders[epoch][i]]

    def eval_problems(self) -> list[Problem]:
        return list(self.evals)

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if self.check(completion, problem.answer) else 0.0
