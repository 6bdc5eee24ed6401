"""Real data: a local JSONL file of ``{"prompt": str, "answer": str}`` and an answer checker.

The checker is math-verify (``pip install -e ".[math]"`` in the checkout) when installed: it parses LaTeX /
plain answers and compares them symbolically. Without it, :func:`exact_match` compares the gold
answer to the completion's final answer -- the content of the last ``\\boxed{...}``, else the text
after the last ``####``, else the whole completion, stripped -- and the run logs that it does so.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

from ..errors import GRPOPartsError
from .arithmetic import Problem

log = logging.getLogger("grpo_parts.train")

#: how to install the optional answer checker, from a checkout of this repository
MATH_INSTALL = 'pip install -e ".[math]"'


def load_jsonl(path: Path | str) -> list[Problem]:
    """Read problems; any bad line raises an error naming the file, the line number and the problem."""
    p = Path(path)
    if not p.is_file():
        raise GRPOPartsError(f"data: no such file {str(p)!r}")
    out: list[Problem] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                rec = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise GRPOPartsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise GRPOPartsError(
                    f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(rec).__name__}"
                )
            missing = [k for k in ("prompt", "answer") if k not in rec]
            if missing:
                raise GRPOPartsError(
                    f"{where}: missing key(s) {missing}; expected 'prompt' and 'answer', got {sorted(rec)}"
                )
            prompt, answer = rec["prompt"], rec["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise GRPOPartsError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise GRPOPartsError(
                    f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}"
                )
            out.append(Problem(prompt, str(answer).strip()))
    if not out:
        raise GRPOPartsError(f"data: {str(p)!r} has no records")
    return out


def final_answer(completion: str) -> str:
    """The completion's final answer for exact matching (see module docstring)."""
    i = completion.rfind("\\boxed{")
    if i >= 0:
        depth, j = 0, i + len("\\boxed{")
        for k in range(j, len(completion)):
            c = completion[k]
            if c == "{":
                depth += 1
            elif c == "}":
                if depth == 0:
                    return completion[j:k].strip()
                depth -= 1
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    return completion.strip()


def exact_match(completion: str, answer: str) -> bool:
    return final_answer(completion) == answer.strip()


def make_checker() -> tuple[Callable[[str, str], bool], str]:
    """``(check(completion, answer) -> bool, description)``: math-verify if installed, else exact match."""
    try:
        from math_verify import parse, verify  # type: ignore[import-not-found]
    except ImportError:
        note = (
            f"math-verify is not installed ({MATH_INSTALL} in the grpo_parts checkout); "
            "grading by exact match of the final answer"
        )
        log.warning(note)
        return exact_match, note

    def check(completion: str, answer: str) -> bool:
        try:
            return bool(verify(parse(answer), parse(completion)))
        except Exception:  # math-verify raises on unparseable input: count it as wrong
            return False

    return check, "math-verify"


class JsonlTask:
    """Problems from a JSONL file: a seeded shuffle per epoch for training, a held-out split for eval."""

    name = "jsonl"

    def __init__(
        self,
        train: list[Problem],
        evals: list[Problem],
        seed: int = 0,
        checker: Callable[[str, str], bool] | None = None,
    ):
        if not train:
            raise GRPOPartsError("data: the training split is empty (lower eval_fraction or add records)")
        self.train, self.evals, self.seed = train, evals, seed
        self.check, self.checker_name = (checker, "custom") if checker is not None else make_checker()
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_files(
        cls, data: Path, eval_data: Path | None = None, eval_fraction: float = 0.05, seed: int = 0
    ) -> JsonlTask:
        records = load_jsonl(data)
        if eval_data is not None:
            return cls(records, load_jsonl(eval_data), seed)
        idx = list(range(len(records)))
        random.Random(f"split:{seed}").shuffle(idx)
        n_eval = max(1, int(round(eval_fraction * len(records))))
        held = set(idx[:n_eval])
        return cls(
            [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)], seed
        )

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
