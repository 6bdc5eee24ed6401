"""Selection by name: one small table per part, lazy imports, explicit ``"auto"`` priority.

Each part's ``__init__`` holds ``IMPLEMENTATIONS: dict[name, "module:Class"]``; a part chosen by
``"auto"`` (attention) also its ``AUTO_PRIORITY``.
Nothing is imported until a name is resolved, and nothing is global state that tests must patch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from .errors import GRPOPartsError

T_co = TypeVar("T_co", covariant=True)


class PartClass(Protocol[T_co]):
    """A registered implementation class, as ``get_<part>_class`` returns it: called with its own
    constructor arguments, it makes a ``T_co`` (the part's Protocol). Not ``type[T_co]``: a
    Protocol's type has no constructor arguments, so a type checker would refuse ``cls(policy)``."""

    __name__: str
    __module__: str

    def __call__(self, *args: Any, **kwargs: Any) -> T_co: ...


def load(table: Mapping[str, str], name: str, part: str) -> Any:
    """Import and return the class registered under ``name`` in ``table``."""
    if name not in table:
        raise GRPOPartsError(f"{part}: unknown implementation {name!r}; expected one of {sorted(table)}")
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def load_class(table: Mapping[str, str], name: str, part: str) -> PartClass[Any]:
    """:func:`load`, typed for ``get_<part>_class`` (which narrows ``Any`` to its Protocol)."""
    return cast("PartClass[Any]", load(table, name, part))


def class_getter(table: Mapping[str, str], part: str) -> Callable[[str], PartClass[Any]]:
    """A part's ``get_<part>_class(name)``: the class registered as ``name`` in ``table`` (imported on
    first use; build it with :mod:`grpo_parts.build`). Each part's ``__init__`` narrows the type."""

    def get(name: str) -> PartClass[Any]:
        return load_class(table, name, part)

    get.__name__ = get.__qualname__ = f"get_{part}_class"
    return get


@dataclass
class Choice:
    """The outcome of ``"auto"`` selection: what was chosen and why the others were refused."""

    name: str
    refused: dict[str, list[str]] = field(default_factory=dict)

    def explain(self) -> str:
        refused = [f"refused {n!r}: " + "; ".join(reasons) for n, reasons in self.refused.items()]
        return "\n".join([f"chose {self.name!r}", *refused])


def choose(
    table: Mapping[str, str], priority: Sequence[str], part: str, reasons_for: Callable[[Any], list[str]]
) -> Choice:
    """Walk ``priority``; return the first implementation whose ``reasons_for(cls)`` is empty."""
    refused: dict[str, list[str]] = {}
    for name in priority:
        try:
            cls = load(table, name, part)
        except ImportError as e:  # optional dependency missing
            refused[name] = [f"import failed: {e}"]
            continue
        reasons = reasons_for(cls)
        if not reasons:
            return Choice(name, refused)
        refused[name] = reasons
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in refused.items())
    raise GRPOPartsError(f"{part}: no implementation supports this input ({detail})")
