"""Run OpenRLHF's own code with some of *its* names bound to grpo_parts classes, without touching any module,
class or builtin that other code sees (OpenRLHF 0.11.2 takes no classes as arguments):
:func:`run_entry_script` runs an entry script as shipped, its imports seeing views of the named modules with
the given attributes replaced; :func:`with_globals` copies one function with a few of its globals replaced."""

from __future__ import annotations

import builtins
import runpy
import types
from collections.abc import Callable, Mapping
from typing import Any

#: module name -> {attribute name -> object that module's attribute reads as, for one script run}
Overrides = Mapping[str, Mapping[str, Any]]


def module_view(module: types.ModuleType, replace: Mapping[str, Any]) -> types.ModuleType:
    """A new module object with ``module``'s attributes, ``replace`` applied on top. ``module`` is
    not changed and the view is not registered in ``sys.modules``."""
    view = types.ModuleType(module.__name__, module.__doc__)
    view.__dict__.update(vars(module))
    view.__dict__.update(replace)
    return view


def scoped_builtins(overrides: Overrides, views: dict[str, types.ModuleType] | None = None) -> dict[str, Any]:
    """A builtins namespace whose ``__import__`` returns :func:`module_view`\\ s for the modules in
    ``overrides`` (absolute imports only); everything else is Python's own. ``views`` (if given)
    collects the views handed out, by module name: the modules the script did import."""
    real_import = builtins.__import__
    views = {} if views is None else views

    def scoped_import(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: tuple[str, ...] | list[str] | None = (),
        level: int = 0,
    ) -> Any:
        module = real_import(name, globals, locals, fromlist, level)
        # ``import a.b`` binds the top package ``a``; ``from a.b import x`` and ``import a`` get
        # the named module itself: only those are replaced.
        if level == 0 and name in overrides and (fromlist or "." not in name):
            if name not in views:
                views[name] = module_view(module, overrides[name])
            return views[name]
        return module

    namespace = dict(vars(builtins))
    namespace["__import__"] = scoped_import
    return namespace


def run_entry_script(
    module_name: str, overrides: Overrides, views: dict[str, types.ModuleType] | None = None
) -> dict[str, Any]:
    """Run ``python -m module_name`` in this process (``runpy.run_module``, ``run_name="__main__"``,
    ``sys`` untouched) with the script's own imports seeing ``overrides``; functions the script defines
    keep the scoped ``__import__``, so imports inside them (e.g. ``train()``'s ``PPOTrainer``) see it too."""
    return runpy.run_module(
        module_name,
        init_globals={"__builtins__": scoped_builtins(overrides, views)},
        run_name="__main__",
        alter_sys=False,
    )


def with_globals(func: Callable[..., Any], **names: Any) -> Callable[..., Any]:
    """A copy of ``func`` reading the global ``names`` from ``names`` (and every other global from a
    snapshot of its module's namespace)."""
    code = func.__code__
    missing = [n for n in names if n not in code.co_names]
    if missing:
        raise KeyError(f"{func.__qualname__} does not read the global(s) {missing}")
    scope = dict(func.__globals__)
    scope.update(names)
    clone = types.FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    clone.__qualname__ = func.__qualname__
    clone.__doc__ = func.__doc__
    clone.__module__ = func.__module__
    return clone
