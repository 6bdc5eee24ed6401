"""A whole run: set up, train with a progress bar, evaluate, checkpoint, report.

The run folder (``out_dir/name``) is created only after the config, model and data have been
validated. ``status.json`` says ``running`` while it trains, ``failed`` (with the error) if it
stops on an exception, and ``completed`` only at the very end -- together with ``report.md`` --
so a folder never claims success it did not reach.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, dump_config
from .loop import GRPOTrainer
from .metrics import MetricsWriter, read_metrics
from .parts import build_parts
from .report import write_report
from .setup import load_setup

log = logging.getLogger("grpo_parts.train")


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]


def _status(run_dir: Path, status: str, **extra: Any) -> None:
    (run_dir / "status.json").write_text(json.dumps({"status": status, "time": time.time(), **extra}) + "\n")


def default_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def build_trainer(config: TrainConfig) -> tuple[GRPOTrainer, list[str]]:
    """Policy, task and parts for ``config`` (validated), wrapped in a :class:`GRPOTrainer`."""
    setup = load_setup(config)
    parts = build_parts(config.parts, setup.policy)
    trainer = GRPOTrainer(
        config, setup.policy, setup.tokenizer, setup.task, parts, setup.eos_token_ids, setup.ref_model
    )
    return trainer, setup.notes + parts.notes


def train(
    config: TrainConfig, run_dir: Path | None = None, resume: bool = False, title: str = ""
) -> RunResult:
    """Run ``config`` into ``run_dir`` (default ``out_dir/name``); ``resume`` continues from its checkpoint."""
    run_dir = run_dir or Path(config.out_dir) / (config.name or default_name())
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        raise GRPOPartsError(
            f"name: run folder {str(run_dir)!r} already exists; choose another name or pass --resume"
        )
    ckpt = load_checkpoint(run_dir) if resume else None
    trainer, notes = build_trainer(config)  # validates everything before the folder exists
    run_dir.mkdir(parents=True, exist_ok=True)
    _status(run_dir, "running")
    (run_dir / "config.yaml").write_text(dump_config(config))
    start_step = 0
    if ckpt is not None:
        trainer.load_state_dict(ckpt["state"])
        start_step = trainer.step_idx
    if not resume:
        (run_dir / "metrics.jsonl").write_text("")
    writer = MetricsWriter(run_dir / "metrics.jsonl", keep_up_to_step=start_step if resume else None)
    try:
        _loop(trainer, writer, run_dir, start_step, notes)
        writer.close()
        rows = read_metrics(run_dir / "metrics.jsonl")
        info = {
            "status": "completed",
            "parts": trainer.parts.describe(),
            "notes": notes,
            "title": title or run_dir.name,
        }
        summary = write_report(run_dir, rows, info, config.target_accuracy)
        _status(run_dir, "completed", summary=summary)
        return RunResult(run_dir, summary, rows)
    except BaseException as e:
        writer.close()
        _status(run_dir, "failed", error=f"{type(e).__name__}: {e}")
        raise


def _loop(
    trainer: GRPOTrainer, writer: MetricsWriter, run_dir: Path, start_step: int, notes: list[str]
) -> None:
    from tqdm.auto import tqdm

    cfg = trainer.config
    cfg_json = cfg.model_dump(mode="json", exclude_unset=True)  # defaults stay defaults on resume
    if start_step == 0:
        acc, t_eval = trainer.evaluate()
        writer.write({"step": 0, "wall_time": 0.0, "eval_accuracy": acc, "eval_time": t_eval})
    bar = tqdm(
        range(start_step, cfg.steps),
        initial=start_step,
        total=cfg.steps,
        disable=not cfg.progress,
        desc="grpo",
        unit="step",
    )
    last_eval: float | None = None
    for _ in bar:
        row = trainer.step()
        done = trainer.step_idx >= cfg.steps or (
            cfg.time_limit_s is not None and trainer.wall_time >= cfg.time_limit_s
        )
        if trainer.step_idx % cfg.eval_every == 0 or done:
            last_eval, row["eval_time"] = trainer.evaluate()
            row["eval_accuracy"] = last_eval
        writer.write(row)
        if cfg.checkpoint_every and trainer.step_idx % cfg.checkpoint_every == 0 and not done:
            save_checkpoint(run_dir, trainer.state_dict(), cfg_json)
        post = {"reward": f"{row['reward']:.2f}", "eval": "-" if last_eval is None else f"{last_eval:.2f}"}
        if row.get("accepted_per_verify") is not None:
            post["acc/verify"] = f"{row['accepted_per_verify']:.2f}"
        bar.set_postfix(post)
        if done:
            break
    bar.close()
    save_checkpoint(run_dir, trainer.state_dict(), cfg_json)


def resume_config(run_dir: Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config a run was started with (from its checkpoint), with ``overrides`` (e.g. more steps)."""
    ckpt = load_checkpoint(run_dir)
    data = dict(ckpt["config"])
    data.update(overrides or {})
    return TrainConfig.model_validate(data)
