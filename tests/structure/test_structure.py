"""The architecture as the tree shows it (issue #37): no import cycle (deferred or not), no private
name imported across modules, no test oracle in a product module, no function over the limit
without its reason, and the old import paths still working."""

from __future__ import annotations

import importlib

import pytest
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


@pytest.mark.parametrize(
    "module, names",
    [
        ("grpo_parts.sampler.speculative", ["SpeculativeSampler", "SpeculativeConfig"]),
        (
            "grpo_parts.attention.shared_prefix",
            ["SharedPrefixAttention", "KERNEL_NAME", "register_attention"],
        ),
        ("grpo_parts.decoding", ["SamplingParams", "sampling_probs", "compact_cache", "tree_ancestors"]),
        ("grpo_parts.filter.skip_protocol", ["PromptSkipper", "prompt_skip_reasons", "prompt_key"]),
        ("grpo_parts.filter.skip_history", ["HistorySkipper"]),
        ("grpo_parts.filter.skip_draw", ["PromptDraw", "lattice_sample", "probabilities_for_target"]),
        ("grpo_parts.filter.reference", ["KeepAll", "KeepEveryPrompt"]),
        ("grpo_parts.filter", ["SKIPPERS", "get_skipper_class", "PromptSkipper"]),
        ("grpo_parts.filter.dppo", ["inclusion_probabilities", "systematic_sample"]),
    ],
)
def test_old_import_paths_still_work(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    for n in names:
        assert getattr(mod, n) is not None, f"{module}.{n}"


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


def test_tests_mirror_the_source_tree() -> None:
    """Every subpackage of ``grpo_parts`` (and every adapter) has its tests in the same place under
    tests/ (docs/index.md, "Architecture")."""
    from structure import ROOT

    src = ROOT / "src" / "grpo_parts"
    packages = sorted(p.name for p in src.iterdir() if (p / "__init__.py").is_file())
    missing = [f"tests/{p}/" for p in packages if not (ROOT / "tests" / p).is_dir()]
    adapters = sorted(p.name for p in (ROOT / "adapters").iterdir() if (p / "__init__.py").is_file())
    missing += [f"tests/adapters/{a}/" for a in adapters if not (ROOT / "tests" / "adapters" / a).is_dir()]
    assert not missing, missing


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
