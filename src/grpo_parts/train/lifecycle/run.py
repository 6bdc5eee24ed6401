"""A whole run: set up, train with a progress bar, evaluate, checkpoint, report, export the model.

The run folder is created only after the config, model, data, parts (and, on resume, the checkpoint)
have been validated, and ``status.json`` (:mod:`.status`) says ``completed`` only at the very end, so a
folder never claims success it did not reach (docs/training.md, "Stopping and resuming").
"""

from __future__ import annotations

import gc
import logging
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import GRPOPartsError
from ...sampler.stats import ACCEPTED_PER_VERIFY
from ..config import TrainConfig, dump_config, load_config
from ..reporting.metrics import MetricsWriter, read_metrics
from ..reporting.report import write_report
from ..reporting.samples import SampleLog
from ..skip_defaults import skip_notes
from ..step.loop import GRPOTrainer
from ..step.parts import build_parts
from .checkpoint import (
    Checkpoint,
    atomic_write_text,
    export_model,
    load_checkpoint,
    save_checkpoint,
    step_name,
)
from .interrupt import Interrupted, StopRequest, signal_name
from .rewind import check_rewind, move_aside
from .setup import hf_progress, load_setup
from .status import check_not_running, write_status
from .trackers import Trackers, check_trackers

log = logging.getLogger("grpo_parts.train")


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]


def default_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def build_trainer(config: TrainConfig) -> tuple[GRPOTrainer, list[str]]:
    setup = load_setup(config)
    parts = build_parts(config.parts, setup.policy, images=setup.processor is not None)
    text_or_images = setup.processor or setup.tokenizer
    trainer = GRPOTrainer(
        config, setup.policy, text_or_images, setup.task, parts, setup.eos_token_ids, setup.ref_model
    )
    return trainer, setup.notes + parts.notes + skip_notes(config)


def check_new_run_dir(run_dir: Path) -> None:
    """A new run needs ``run_dir`` to be absent or an empty folder, under folders it can write to."""
    if run_dir.exists() and not run_dir.is_dir():
        raise GRPOPartsError(f"name: {str(run_dir)!r} is a file; expected a new run folder there")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise GRPOPartsError(
            f"name: run folder {str(run_dir)!r} already exists; choose another name or pass --resume"
        )
    parent = run_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise GRPOPartsError(f"out_dir: {str(parent)!r} is a file; expected a folder to hold run folders")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GRPOPartsError(f"out_dir: cannot create folders in {str(parent)!r} (permission denied)")


def check_resume_steps(run_dir: Path, ckpt: Checkpoint, steps: int, completed: bool) -> None:
    if steps < ckpt.step:
        raise GRPOPartsError(
            f"resume: --steps {steps} is below the {ckpt.step} steps {str(run_dir)!r} has done; "
            f"expected --steps >= {ckpt.step}"
        )
    if completed and steps == ckpt.step:
        raise GRPOPartsError(
            f"resume: {str(run_dir)!r} has completed its {steps} steps; pass --steps N with N > {steps} "
            "to train further"
        )


class RunSession:
    """One run folder being trained: ``begin()``, ``advance()`` until ``done``, then ``finish()``
    (``--compare`` drives several in alternation, so that load on a shared machine hits every arm alike)."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path | None = None,
        resume: bool = False,
        title: str = "",
        rewind: bool = False,
    ):
        self.config, self.resume, self.title, self.rewind = config, resume, title, rewind
        check_trackers(config.report_to)  # a missing tracker library: one line before anything runs
        ckpt = None
        if resume:
            if run_dir is None:
                raise GRPOPartsError("resume: expected the run folder to resume")
            ckpt = self._read_checkpoint(run_dir)
        else:
            self.run_dir = run_dir or Path(config.out_dir) / (config.name or default_name())
            check_new_run_dir(self.run_dir)
        self.trainer, self.notes = build_trainer(config)  # validates everything before the folder exists
        self.start_step, self.saved_step = 0, None if ckpt is None else ckpt.step
        self.finished = 0  # the last step whose metrics row is written
        if ckpt is not None:
            self._load(ckpt)
            self.start_step = self.finished = ckpt.step
            if rewind:  # everything validated: only now is the later state moved aside
                move_aside(self.run_dir, ckpt.step)
        self.cfg_json = config.model_dump(mode="json", exclude_unset=True)  # defaults stay defaults on resume
        self._open_folder()
        self.done = self.start_step >= config.steps
        self.grader_name = str(getattr(self.trainer.task, "grader_name", "the task's"))
        self.last_eval: float | None = None
        self.traces: dict[int, dict[str, Any]] = {}  # the sampler's decode trace: first and last step

    def _read_checkpoint(self, path: Path) -> Checkpoint:
        """The checkpoint to resume from, read whole and checked against the config's steps."""
        self.run_dir, meta = load_checkpoint(path, full=False)  # cheap checks first
        self.old_steps = TrainConfig.model_validate(meta.config).steps
        status = check_not_running(self.run_dir)
        completed = status is not None and status.get("status") == "completed"
        check_resume_steps(self.run_dir, meta, self.config.steps, completed)
        check_rewind(self.run_dir, meta, self.rewind)
        return load_checkpoint(meta.folder)[1]

    def _load(self, ckpt: Checkpoint) -> None:
        assert ckpt.state is not None
        try:
            self.trainer.load_state_dict(ckpt.state)
        except (RuntimeError, KeyError, ValueError) as e:  # e.g. a policy of another shape
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GRPOPartsError(
                f"resume: {ckpt.folder} does not fit this run's model or parts: {msg}"
            ) from None

    def _open_folder(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        yaml_path = self.run_dir / "config.yaml"
        if not self.resume:
            yaml_path.write_text(dump_config(self.config))
        elif self.config.steps != self.old_steps:  # the one field a resume may change (--steps)
            log.info("config.yaml: steps %d -> %d (resumed with --steps)", self.old_steps, self.config.steps)
            atomic_write_text(yaml_path, dump_config(self.config))
        keep = self.start_step if self.resume else None
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl", keep_up_to_step=keep)
        self.samples = SampleLog(self.run_dir / "samples.jsonl", self.config, keep_up_to_step=keep)
        self._status("running")
        name = "/".join(self.run_dir.parts[-2:]) if self.title else self.run_dir.name  # --compare: cmp/arm
        try:
            self.trackers = Trackers(
                list(self.config.report_to), self.run_dir, name, self.config.model_dump(mode="json"),
                dump_config(self.config),
            )  # fmt: skip
        except GRPOPartsError as e:
            self.fail(e)
            raise

    def _status(self, status: str, **extra: Any) -> None:
        ckpt = None if self.saved_step is None else f"checkpoints/{step_name(self.saved_step)}"
        write_status(self.run_dir, status, step=self.finished, checkpoint=ckpt, **extra)

    def save(self) -> None:
        save_checkpoint(self.run_dir, self.trainer.state_dict(), self.cfg_json, previous=self.saved_step)
        self.saved_step = self.trainer.step_idx

    def begin(self) -> None:
        if not self.resume:  # a resumed run has its step-0 row: checkpoints come after it
            acc, t_eval = self.trainer.evaluate()
            self._write({"step": 0, "wall_time": 0.0, "eval_accuracy": acc, "eval_time": t_eval})
            self.samples.write(0, self.trainer.eval_samples, [])

    def _write(self, row: dict[str, Any]) -> None:
        self.writer.write(row)
        self.trackers.log(row)

    def advance(self) -> dict[str, Any]:
        """One GRPO step (+ evaluation and checkpoint when due); returns its metrics row."""
        cfg, trainer = self.config, self.trainer
        row = trainer.step()
        flat = self.samples.check_flat(trainer.step_idx, trainer.last_samples, self.grader_name)
        if trainer.last_trace is not None and trainer.last_trace["k"]:
            self.traces = {k: v for k, v in self.traces.items() if k == min(self.traces, default=k)}
            self.traces[trainer.step_idx] = trainer.last_trace
        self.done = trainer.step_idx >= cfg.steps or (
            cfg.time_limit_s is not None and trainer.wall_time >= cfg.time_limit_s
        )
        if trainer.step_idx % cfg.eval_every == 0 or self.done:
            self.last_eval, row["eval_time"] = trainer.evaluate()
            row["eval_accuracy"] = self.last_eval
            self.samples.write(trainer.step_idx, trainer.eval_samples, trainer.last_samples)
        self._write(row)
        self.finished = trainer.step_idx
        if flat:
            self.save()
            raise GRPOPartsError(
                f"{flat}; resume with: grpo-parts train --resume {shlex.quote(str(self.run_dir))}"
            )
        if cfg.checkpoint_every and trainer.step_idx % cfg.checkpoint_every == 0 and not self.done:
            self.save()
        self._status("running")  # a heartbeat: the step and time a reader sees
        return row

    def finish(self) -> RunResult:
        if self.saved_step != self.trainer.step_idx:
            self.save()
        with hf_progress(self.config.progress):
            export_model(self.run_dir, self.trainer.policy, self.trainer.tokenizer)
        self.writer.close()
        self.samples.close()
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        info = {
            "status": "completed",
            "parts": self.trainer.parts.describe(),
            "notes": self.notes,
            "title": self.title or self.run_dir.name,
            "traces": self.traces,
            "samples": self.samples.last_eval,
        }
        summary = write_report(self.run_dir, rows, info, self.config.target_accuracy)
        self.trackers.finish("completed")
        self._status("completed", summary=summary)
        return RunResult(self.run_dir, summary, rows)

    def note_stop(self, signum: int) -> None:
        log.info(
            "%s: finishing step %d, then saving a checkpoint (send it again to stop at once)",
            signal_name(signum), self.finished + 1,
        )  # fmt: skip

    def interrupted(self, signum: int, step_finished: bool) -> Interrupted:
        """Save the last finished step (when the signal waited for it), mark the folder ``interrupted``,
        and return the exception whose message tells the user how to resume."""
        if step_finished and self.saved_step != self.trainer.step_idx:
            self.save()
        self._close("interrupted")
        name, cmd = signal_name(signum), f"grpo-parts train --resume {shlex.quote(str(self.run_dir))}"
        where = f"after step {self.finished}" if step_finished else f"during step {self.finished + 1}"
        if self.saved_step is None:
            msg = f"interrupted by {name} {where}, before the first checkpoint; nothing to resume"
            self._status("interrupted", signal=name, resume=None)
        else:
            msg = f"interrupted by {name} {where}; resume from step {self.saved_step} with: {cmd}"
            self._status("interrupted", signal=name, resume=cmd)
        return Interrupted(signum, f"grpo-parts train: {msg}")

    def fail(self, e: BaseException) -> None:
        if isinstance(e, (Interrupted, KeyboardInterrupt)):
            self.interrupted(getattr(e, "signum", 2), step_finished=False)
            return
        self._close("failed")
        self._status("failed", error=f"{type(e).__name__}: {e}")

    def _close(self, status: str) -> None:
        self.writer.close()
        self.samples.close()
        if hasattr(self, "trackers"):  # (not yet there when the trackers themselves failed to start)
            self.trackers.finish(status)


def postfix(session: RunSession, row: dict[str, Any]) -> dict[str, str]:
    post = {
        "reward": f"{row['reward']:.2f}",
        "eval": "-" if session.last_eval is None else f"{session.last_eval:.2f}",
    }
    if row.get(ACCEPTED_PER_VERIFY) is not None:
        post["acc/verify"] = f"{row[ACCEPTED_PER_VERIFY]:.2f}"
    return post


def train(
    config: TrainConfig, run_dir: Path | None = None, resume: bool = False, rewind: bool = False
) -> RunResult:
    """Run ``config`` into ``run_dir`` (default ``out_dir/name``); ``resume`` continues from its checkpoint
    (``run_dir`` is then the run folder, or one of its ``checkpoints/step-NNNNNN`` folders; an earlier
    checkpoint than the newest needs ``rewind``: :mod:`.rewind`). Raises :class:`~.interrupt.Interrupted`
    on SIGINT/SIGTERM, after saving what resumes."""
    session = RunSession(config, run_dir, resume, rewind=rewind)
    with StopRequest(session.note_stop) as stop, setup_frozen():
        try:
            _steps(session, stop)
            if session.done:  # (a signal during the last step or from here on: the run completes)
                return session.finish()
        except Interrupted as e:  # a second signal: mid-step, so the newest checkpoint resumes
            raise session.interrupted(e.signum, step_finished=False) from None
        except BaseException as e:
            session.fail(e)
            raise
        assert stop.signum is not None
        raise session.interrupted(stop.signum, step_finished=True)


@contextmanager
def setup_frozen() -> Iterator[None]:
    """Everything set-up created moved out of the garbage collector's view for the run (``gc.freeze``;
    otherwise every full collection walks it all, inside whichever step it lands: docs/speculative.md),
    for both arms alike. A caller that froze objects itself keeps its own arrangement."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()  # set-up's own garbage goes now, not into the frozen set
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _steps(session: RunSession, stop: StopRequest) -> None:
    from tqdm.auto import tqdm

    session.begin()
    with tqdm(
        initial=session.start_step,
        total=session.config.steps,
        disable=not session.config.progress,
        desc="grpo",
        unit="step",
    ) as bar:
        while not session.done and stop.signum is None:
            row = session.advance()
            bar.update(1)
            bar.set_postfix(postfix(session, row))


def resume_config(path: Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config a run was started with (from its newest checkpoint, or the checkpoint folder
    ``path``), with ``overrides`` (e.g. more steps)."""
    _, ckpt = load_checkpoint(path, full=False)
    return load_config(None, {**ckpt.config, **(overrides or {})})
