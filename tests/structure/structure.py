"""Static facts about the source tree, read with ``ast`` (nothing is imported): the import graph
of ``grpo_parts`` and ``grpo_parts_adapters`` (every import, at module level or deferred inside a
function), private names imported across modules, and function lengths. tests/structure/ asserts
on them; ``python tests/structure/structure.py`` prints them."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"grpo_parts": ROOT / "src" / "grpo_parts", "grpo_parts_adapters": ROOT / "adapters"}
#: a function longer than this needs a reason in its docstring ("Long because ...")
MAX_FUNCTION_LINES = 60
LONG_REASON = "Long because"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module


def modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [top, *rel.parts]
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join(parts)
            out[name] = Module(name, path, is_pkg, ast.parse(path.read_text(), str(path)))
    return out


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: Module, known: dict[str, Module]) -> Iterator[tuple[str, str, int]]:
    """``(target module, imported name or "", line)`` for every import of ``mod`` into our packages:
    module level, deferred inside a function, or under ``typing.TYPE_CHECKING`` (a cycle a type
    checker needs is still a cycle a reader has to untangle)."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known:  # `from pkg import module`
                    yield sub, "", node.lineno
                else:
                    yield target, a.name, node.lineno


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {n: set() for n in known}
    for name, mod in known.items():
        for target, _, _ in imports(mod, known):
            # importing a.b.c runs a/__init__ and a/b/__init__ first; the edge that can close a cycle
            # is the one to the module named (a package's __init__ importing its own submodules is
            # how packages work, and a submodule importing a *sibling* is not a cycle through it).
            if target in graph and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_imports() -> list[str]:
    """``module:line imports other.module._name``: a private name used outside the module that
    defines it (a package's own ``__init__`` re-exporting from its submodules is allowed)."""
    known = modules()
    out = []
    for mod in known.values():
        for target, imported, line in imports(mod, known):
            leaf = imported or target.rsplit(".", 1)[-1]
            if not leaf.startswith("_") or leaf.startswith("__"):
                continue
            out.append(
                f"{mod.path.relative_to(ROOT)}:{line} imports {target}{'.' + imported if imported else ''}"
            )
    return out


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions over ``limit`` lines (decorators and docstring included) whose docstring gives no
    reason (``Long because ...``)."""
    out = []
    for mod in modules().values():
        for node in ast.walk(mod.tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if n > limit and LONG_REASON not in doc:
                out.append(f"{mod.path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


if __name__ == "__main__":
    g = import_graph()
    print("cycles:")
    for c in cycles(g):
        print("  ", " <-> ".join(c))
    print("private imports:")
    for p in private_imports():
        print("  ", p)
    print(f"functions over {MAX_FUNCTION_LINES} lines without a reason:")
    for f in long_functions():
        print("  ", f)
