"""The usage example in docs/filter.md runs and prints what the page says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "filter.md"


def test_usage_example_runs() -> None:
    text = DOC.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code.group(1), str(DOC), "exec"), {})
    assert buf.getvalue().strip() == "[0, 4, 5, 7] 2"
