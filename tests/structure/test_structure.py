"""The architecture as the tree shows it (issue #37): no import cycle (deferred or not), no private
name imported across modules, no test oracle in a product module, no function over the limit
without its reason."""

from __future__ import annotations

from pathlib import Path

from structure import (
    LONG_REASON,
    MAX_FUNCTION_LINES,
    cycles,
    import_graph,
    long_functions,
    modules,
    private_imports,
)


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (module level or deferred): " + "; ".join(" <-> ".join(c) for c in found)


def test_graph_sees_deferred_and_relative_imports() -> None:
    # the checker itself: a deferred relative import inside a function is an edge
    g = import_graph()
    assert "grpo_parts.sampler.speculative.decode_loop" in g["grpo_parts.sampler.speculative.sampler"]
    assert any(t.startswith("grpo_parts.") for t in g["grpo_parts_adapters.trl.trainer"])


def test_no_private_names_across_modules() -> None:
    found = private_imports()
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def test_no_long_function_without_a_reason() -> None:
    found = long_functions()
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines whose docstring gives no '{LONG_REASON} ...':\n"
        + "\n".join(found)
    )


def test_product_never_imports_the_test_oracles() -> None:
    known = modules()
    g = import_graph()
    users = sorted(m for m, targets in g.items() if any(t.startswith("grpo_parts.testing") for t in targets))
    assert users == [] or all(u.startswith("grpo_parts.testing") for u in users), users
    # deliberately broken verifiers live with the tests (tests/oracles.py), in no product module
    for name, mod in known.items():
        defined = {n.name for n in mod.tree.body if hasattr(n, "name")}
        assert not defined & {"always_accept", "tree_always_accept", "rrs_without_q_update"}, name


def test_decoding_all_is_honest() -> None:
    import grpo_parts.decoding as d

    for n in d.__all__:
        assert hasattr(d, n), n
    # every name another module imports from the package is in __all__
    known = modules()
    from structure import imports

    used = {
        imp
        for mod in known.values()
        for t, imp, _ in imports(mod, known)
        if t == "grpo_parts.decoding" and imp
    }
    assert used <= set(d.__all__), used - set(d.__all__)


#: test folders that mirror no package, and why (every other folder under tests/ mirrors one)
CROSS_CUTTING = {
    "structure": "facts about the whole tree (this folder)",
    "examples": "the runnable scripts in examples/",
    "scripts": "the scripts in scripts/ (CI, measurements)",
}


def _package_folders(root: Path) -> list[Path]:
    """``root`` and every package below it, relative to ``root`` (``.`` for ``root`` itself)."""
    return sorted(d.parent.relative_to(root) for d in root.rglob("__init__.py"))


def test_tests_mirror_the_source_tree() -> None:
    """At every level, ``tests/x/y/test_z.py`` tests ``src/grpo_parts/x/y/z.py`` (and
    ``tests/adapters/<fw>/...`` the adapters): every package and subpackage has its folder under
    tests/ with tests in it, and every test module sits in a package's folder or in a
    :data:`CROSS_CUTTING` one (docs/index.md, "Architecture")."""
    from structure import PACKAGES, ROOT

    tests = ROOT / "tests"
    mirrors: dict[Path, Path] = {}
    for top, folder in PACKAGES.items():
        base = tests / "adapters" if top == "grpo_parts_adapters" else tests
        for rel in _package_folders(folder):
            mirrors[base / rel] = folder / rel
    untested = [
        f"{m.relative_to(ROOT)}/ for {src.relative_to(ROOT)}/"
        for m, src in sorted(mirrors.items())
        if not any(m.rglob("test_*.py"))
    ]
    assert not untested, "packages without a tests folder that holds their tests: " + "; ".join(untested)
    stray = sorted(
        str(t.relative_to(ROOT))
        for t in tests.rglob("test_*.py")
        if t.parent not in mirrors and t.relative_to(tests).parts[0] not in CROSS_CUTTING
    )
    assert not stray, "test modules in a folder that mirrors no package (nor is cross-cutting): " + ", ".join(
        stray
    )
    gone = sorted(f for f in CROSS_CUTTING if not (tests / f).is_dir())
    assert not gone, f"CROSS_CUTTING names folders tests/ no longer has: {gone}"


def test_no_planner_outside_the_backend_package() -> None:
    """A shared-prefix call is planned in grpo_parts.attention.shared_prefix only: no module under
    adapters/ calls the grid planner or defines a plan of its own (issue #43)."""
    import ast

    planners = {"chunk_plan", "split_long_tails", "make_plan", "choose_layout", "auto_costs"}
    found = []
    for name, mod in modules().items():
        if not name.startswith("grpo_parts_adapters"):
            continue
        for node in ast.walk(mod.tree):
            called = isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", ""))
            if called in planners or (isinstance(node, ast.ClassDef) and node.name.endswith("Plan")):
                found.append(f"{name}:{node.lineno}")
    assert not found, found
