"""Built-in verifiable task (chain addition), its offline tokenizer, and JSONL data for real runs."""

from __future__ import annotations

from .arithmetic import ArithmeticConfig, ArithmeticTask
from .data import Problem

__all__ = ["ArithmeticConfig", "ArithmeticTask", "Problem"]
