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


class RunSession:
    """One run folder being trained: ``begin()``, ``advance()`` until ``done``, then ``finish()``.

    Everything is validated (model, data, parts) before the folder is created. ``--compare`` drives
    two sessions in alternation, so that load on a shared machine hits both arms alike.
    """

    def __init__(
        self, config: TrainConfig, run_dir: Path | None = None, resume: bool = False, title: str = ""
    ):
        self.config, self.resume, self.title = config, resume, title
        self.run_dir = run_dir or Path(config.out_dir) / (config.name or default_name())
        if not resume and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise GRPOPartsError(
                f"name: run folder {str(self.run_dir)!r} already exists; choose another name or pass --resume"
            )
        ckpt = load_checkpoint(self.run_dir) if resume else None
        self.trainer, self.notes = build_trainer(config)  # validates everything before the folder exists
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _status(self.run_dir, "running")
        (self.run_dir / "config.yaml").write_text(dump_config(config))
        self.start_step = 0
        if ckpt is not None:
            self.trainer.load_state_dict(ckpt["state"])
            self.start_step = self.trainer.step_idx
        if not resume:
            (self.run_dir / "metrics.jsonl").write_text("")
        self.writer = MetricsWriter(
            self.run_dir / "metrics.jsonl", keep_up_to_step=self.start_step if resume else None
        )
        self.cfg_json = config.model_dump(mode="json", exclude_unset=True)  # defaults stay defaults on resume
        self.done = self.start_step >= config.steps
        self.last_eval: float | None = None

    def begin(self) -> None:
        if self.start_step == 0:
            acc, t_eval = self.trainer.evaluate()
            self.writer.write({"step": 0, "wall_time": 0.0, "eval_accuracy": acc, "eval_time": t_eval})

    def advance(self) -> dict[str, Any]:
        """One GRPO step (+ evaluation and checkpoint when due); returns its metrics row."""
        cfg, trainer = self.config, self.trainer
        row = trainer.step()
        self.done = trainer.step_idx >= cfg.steps or (
            cfg.time_limit_s is not None and trainer.wall_time >= cfg.time_limit_s
        )
        if trainer.step_idx % cfg.eval_every == 0 or self.done:
            self.last_eval, row["eval_time"] = trainer.evaluate()
            row["eval_accuracy"] = self.last_eval
        self.writer.write(row)
        if cfg.checkpoint_every and trainer.step_idx % cfg.checkpoint_every == 0 and not self.done:
            save_checkpoint(self.run_dir, trainer.state_dict(), self.cfg_json)
        return row

    def finish(self) -> RunResult:
        save_checkpoint(self.run_dir, self.trainer.state_dict(), self.cfg_json)
        self.writer.close()
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        info = {
            "status": "completed",
            "parts": self.trainer.parts.describe(),
            "notes": self.notes,
            "title": self.title or self.run_dir.name,
        }
        summary = write_report(self.run_dir, rows, info, self.config.target_accuracy)
        _status(self.run_dir, "completed", summary=summary)
        return RunResult(self.run_dir, summary, rows)

    def fail(self, e: BaseException) -> None:
        self.writer.close()
        _status(self.run_dir, "failed", error=f"{type(e).__name__}: {e}")


def postfix(session: RunSession, row: dict[str, Any]) -> dict[str, str]:
    post = {
        "reward": f"{row['reward']:.2f}",
        "eval": "-" if session.last_eval is None else f"{session.last_eval:.2f}",
    }
    if row.get("accepted_per_verify") is not None:
        post["acc/verify"] = f"{row['accepted_per_verify']:.2f}"
    return post


def train(
    config: TrainConfig, run_dir: Path | None = None, resume: bool = False, title: str = ""
) -> RunResult:
    """Run ``config`` into ``run_dir`` (default ``out_dir/name``); ``resume`` continues from its checkpoint."""
    from tqdm.auto import tqdm

    session = RunSession(config, run_dir, resume, title)
    try:
        session.begin()
        with tqdm(
            initial=session.start_step,
            total=config.steps,
            disable=not config.progress,
            desc="grpo",
            unit="step",
        ) as bar:
            while not session.done:
                row = session.advance()
                bar.update(1)
                bar.set_postfix(postfix(session, row))
        return session.finish()
    except BaseException as e:
        session.fail(e)
        raise


def resume_config(run_dir: Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config a run was started with (from its checkpoint), with ``overrides`` (e.g. more steps)."""
    ckpt = load_checkpoint(run_dir)
    data = dict(ckpt["config"])
    data.update(overrides or {})
    return TrainConfig.model_validate(data)
