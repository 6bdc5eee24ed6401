"""Built-in verifiable task (chain addition), its offline tokenizer, and JSONL data for real runs."""

from __future__ import annotations

from .arithmetic import ArithmeticConfig, ArithmeticTask, Problem

__all__ = ["ArithmeticConfig", "ArithmeticTask", "Problem"]
