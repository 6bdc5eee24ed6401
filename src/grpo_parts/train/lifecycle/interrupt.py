"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM: the first signal lets the step in progress
finish and checkpoints it (a step changes the RNG, data position, draft, policy and optimizer at
different moments, and only a finished step resumes exactly); a second one stops at once, mid-step
(docs/training.md, "Stopping and resuming")."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A run stopped by a signal. A ``BaseException``, like ``KeyboardInterrupt``, so that an
    ``except Exception`` on the way does not swallow it. ``str()`` is the line for the user."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        super().__init__(message or f"grpo-parts train: interrupted by {signal_name(signum)}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


@contextmanager
def _handlers(handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM inside the block (main thread only: Python delivers signals
    there; elsewhere this does nothing and the defaults apply)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def raise_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` (SIGTERM would otherwise kill without a word)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    with _handlers(handler):
        yield


class StopRequest:
    """Inside ``with StopRequest(note) as stop:``, the first SIGINT/SIGTERM sets ``stop.signum`` and
    calls ``note(signum)``; a second one raises :class:`Interrupted`."""

    def __init__(self, note: Callable[[int], None]):
        self.signum: int | None = None
        self.note = note
        self._cm = _handlers(self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        self.note(signum)

    def __enter__(self) -> StopRequest:
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
