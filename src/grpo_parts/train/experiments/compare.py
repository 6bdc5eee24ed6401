"""``grpo-parts train --compare`` / ``grpo-parts bench e2e``: reference parts vs optimized parts, run in
alternation so that load on a shared machine slows both alike (docs/training.md, "--compare")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import GRPOPartsError
from ..config import TrainConfig
from ..lifecycle.run import RunResult, RunSession, default_name, postfix
from ..reporting.report import write_compare
from ..step.parts import resolve_name
from .ablation import ablation_configs
from .arms import DEFAULT_ARMS, aggregate_arms, arm_configs, arms_markdown, write_arms
from .seeds import aggregate_seeds, seeds_markdown


def compare(
    config: TrainConfig,
    out_dir: Path | None = None,
    json_path: Path | None = None,
    ablate: bool = False,
    arms: list[str] | None = None,
) -> dict[str, Any]:
    """Reference vs optimized parts; with ``ablate``, also one arm per optimized part (see ``ablation``);
    with ``arms`` other than the default pair, those arms side by side (:mod:`.arms`: arms.{json,md,png})."""
    out_dir = out_dir or Path(config.out_dir) / (config.name or f"compare-{default_name()}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GRPOPartsError(f"name: folder {str(out_dir)!r} already exists; choose another --name")
    if arms is not None and tuple(arms) != DEFAULT_ARMS:
        if ablate:
            raise GRPOPartsError(
                "--ablate: compares the default arms only (reference, optimized), got --arms"
            )
        _, results = _run_alternating(arm_configs(config, arms), out_dir)
        rows = {a: r.rows for a, r in results.items()}
        result = write_arms(out_dir, rows, config.target_accuracy, {"seed": config.seed})
        md = "arms.md"
    else:
        configs = {"reference": config.with_reference_parts(), "optimized": config}
        if ablate:
            configs.update(ablation_configs(config))
        sessions, results = _run_alternating(configs, out_dir)
        rows = {arm: r.rows for arm, r in results.items()}
        described = {arm: s.trainer.parts.describe() for arm, s in sessions.items()}
        result = write_compare(
            out_dir, rows, config.target_accuracy, {"parts": described, "seed": config.seed}
        )
        md = "compare.md"
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    result["markdown"] = (out_dir / md).read_text() + f"\nFolder: {out_dir}\n"
    return result


def _run_alternating(
    configs: dict[str, TrainConfig], out_dir: Path
) -> tuple[dict[str, RunSession], dict[str, RunResult]]:
    """Set every arm up (all validated before any trains), then step them in turn."""
    for cfg in configs.values():  # an unknown part name fails before any folder exists
        for part in ("sampler", "draft", "attention", "filter"):
            resolve_name(part, cfg.parts, [])
    sessions: dict[str, RunSession] = {}
    try:
        for arm, cfg in configs.items():
            sessions[arm] = RunSession(cfg, run_dir=out_dir / arm, title=f"{arm} parts")
        first = next(iter(configs.values()))
        return sessions, _alternate(sessions, first.steps, first.progress)
    except BaseException as e:
        for s in sessions.values():
            s.fail(e)
        raise


def _alternate(sessions: dict[str, RunSession], steps: int, progress: bool) -> dict[str, RunResult]:
    """Step the sessions in turn (one step each), so a busy machine slows both arms alike."""
    from tqdm.auto import tqdm

    for s in sessions.values():
        s.begin()
    with tqdm(total=steps * len(sessions), disable=not progress, desc="compare", unit="step") as bar:
        while not all(s.done for s in sessions.values()):
            for arm, s in sessions.items():
                if not s.done:
                    row = s.advance()
                    bar.update(1)
                    bar.set_postfix({"arm": arm, **postfix(s, row)})
    return {arm: s.finish() for arm, s in sessions.items()}


def compare_seeds(
    config: TrainConfig,
    seeds: int,
    out_dir: Path | None = None,
    json_path: Path | None = None,
    ablate: bool = False,
    arms: list[str] | None = None,
) -> dict[str, Any]:
    """:func:`compare` for ``seeds`` consecutive seeds from ``config.seed``, each in ``<run>/seed<S>``,
    plus ``<run>/compare_seeds.{json,md}``: time to target moves by several steps between seeds, so
    one seed says little (:mod:`.seeds` reports medians and means over them)."""
    out_dir = out_dir or Path(config.out_dir) / (config.name or f"compare-{default_name()}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GRPOPartsError(f"name: folder {str(out_dir)!r} already exists; choose another --name")
    per_seed = []
    for s in range(config.seed, config.seed + seeds):
        res = compare(config.model_copy(update={"seed": s}), out_dir / f"seed{s}", ablate=ablate, arms=arms)
        res.pop("markdown", None)
        per_seed.append(res)
    seed_list = list(range(config.seed, config.seed + seeds))
    if arms is not None and tuple(arms) != DEFAULT_ARMS:  # every arm's medians over the seeds
        result, name, markdown = aggregate_arms(per_seed, seed_list), "arms_seeds", arms_markdown
    else:
        result = aggregate_seeds(per_seed, config.target_accuracy, seed_list)
        name, markdown = "compare_seeds", seeds_markdown
    text = json.dumps(result, indent=2) + "\n"
    (out_dir / f"{name}.json").write_text(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
    lines = markdown(result)
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    result["markdown"] = "\n".join(lines) + f"\n\nFolder: {out_dir}\n"
    return result
