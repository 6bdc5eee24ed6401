"""Named answer graders: ``grade(completion, answer) -> bool``, chosen by ``task.grader`` (``exact``,
``after_delimiter``, ``boxed``, ``last_number``, ``math_verify``; each rule and ``auto``'s choice:
docs/training.md, "Graders"). A gold answer is compared as given; the data loader has already
reduced GSM8K/MATH solutions to their final answers (:mod:`.formats`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from ..errors import GRPOPartsError, install_hint

#: how to install the optional answer checker, from a checkout of this repository
MATH_INSTALL = install_hint("math")

GRADERS = ("exact", "after_delimiter", "boxed", "last_number", "math_verify")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")

Grade = Callable[[str, str], bool]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{")
    for k in range(j, len(text)):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                return text[j:k].strip()
            depth -= 1
    return None


def after_delimiter(text: str, delimiter: str) -> str | None:
    """The text after the last ``delimiter`` (stripped), or None when there is none."""
    if delimiter not in text:
        return None
    return text.rsplit(delimiter, 1)[1].strip()


def final_answer(completion: str) -> str:
    """The final answer for ``exact``: the last ``\\boxed{}``, else after the last ``####``, else all."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    after = after_delimiter(completion, "####")
    return after if after is not None else completion.strip()


def _number(text: str) -> Fraction | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(completion: str, answer: str) -> bool:
    return final_answer(completion) == answer.strip()


def make_grader(name: str, delimiter: str = ";") -> Grade:
    """The grader called ``name`` (one of :data:`GRADERS`); math_verify must be installed."""
    if name == "exact":
        return exact_match
    if name == "after_delimiter":
        if not delimiter:
            raise GRPOPartsError(
                "task.delimiter: got an empty string; expected e.g. ';', '####' or 'answer:'"
            )
        return lambda c, a: after_delimiter(c, delimiter) == a.strip()
    if name == "boxed":
        return lambda c, a: last_boxed(c) == a.strip()
    if name == "last_number":

        def last_number(completion: str, answer: str) -> bool:
            gold = _number(answer)
            return gold is not None and _number(completion) == gold

        return last_number
    if name == "math_verify":
        return _math_verify()
    raise GRPOPartsError(f"task.grader: got {name!r}; expected one of {', '.join(GRADERS)}")


def math_verify_installed() -> bool:
    try:
        import math_verify  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def _math_verify() -> Grade:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise GRPOPartsError(
            f"task.grader: 'math_verify' needs the math-verify package ({MATH_INSTALL}); expected it "
            "installed, or another grader (exact, after_delimiter, boxed, last_number)"
        ) from None

    def check(completion: str, answer: str) -> bool:
        try:
            return bool(verify(parse(answer), parse(completion)))
        except Exception:  # math-verify raises on unparseable input: count it as wrong
            return False

    return check


def describe(name: str, delimiter: str) -> str:
    return f"after_delimiter {delimiter!r}" if name == "after_delimiter" else name
