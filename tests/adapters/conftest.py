"""Make ``grpo_parts_adapters`` (the folder ``adapters/``) importable when the package was not
(re)installed with ``pip install -e .``; an installed package wins."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:
    import grpo_parts_adapters  # noqa: F401
except ImportError:
    _root = Path(__file__).resolve().parents[2] / "adapters"
    _spec = importlib.util.spec_from_file_location(
        "grpo_parts_adapters", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["grpo_parts_adapters"] = _mod
    _spec.loader.exec_module(_mod)
