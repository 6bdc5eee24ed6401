"""Experiment trackers (``report_to``): TensorBoard, Weights & Biases, MLflow, Trackio, each through
its library's own API, imported only when asked for; tracker runs are named after the run folder and
resumed with it (``trackers.json``). What each writes where: docs/training.md, "Experiment trackers"."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import GRPOPartsError, install_hint

log = logging.getLogger("grpo_parts.train")
IDS_FILE = "trackers.json"


def check_trackers(names: Sequence[str]) -> None:
    """One-line :class:`GRPOPartsError` for the first requested tracker whose library is not installed."""
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise GRPOPartsError(
                f"report_to: {name!r} needs the {name} package, which is not installed; expected it "
                f"installed: {install_hint(name)} (or leave {name} out of --report-to)"
            )


def flatten(tree: Any, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dicts -> one level, keys joined by ``sep``."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{sep}{k}" if prefix else str(k), sep))
    return out


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The loggable scalars of a metrics row (``step`` is the axis, not a metric)."""
    return {k: float(v) for k, v in flatten(row).items() if k != "step" and isinstance(v, (int, float))}


class _TensorBoard:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], config_yaml: str, ids: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```yaml\n" + config_yaml + "```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], config_yaml: str, ids: dict) -> None:
        import wandb

        project = os.environ.get("WANDB_PROJECT") or config.get("project") or "grpo-parts"
        self.run = wandb.init(
            project=project, name=name, dir=str(run_dir), config=config, id=ids.get("wandb"),
            resume="allow" if ids.get("wandb") else None, reinit="create_new",
        )  # fmt: skip
        ids["wandb"] = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


class _MLflow:
    STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], config_yaml: str, ids: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
            client.update_run(self.run_id, status="RUNNING")
            return
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.get("project") or "grpo-parts"
        exp = client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(exp_name)
        self.run_id = ids["mlflow"] = client.create_run(exp_id, run_name=name).info.run_id
        params = [
            Param(k, json.dumps(v) if not isinstance(v, str) else v)
            for k, v in flatten(config, sep=".").items()
        ]
        client.log_batch(self.run_id, params=params)
        client.log_text(self.run_id, config_yaml, "config.yaml")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS.get(status, "FAILED"))


class _Trackio:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], config_yaml: str, ids: dict) -> None:
        import trackio

        project = config.get("project") or "grpo-parts"
        with _quiet():  # trackio prints its banner on stdout, where our one result line goes
            self.run = trackio.init(
                project=project, name=name, config=config, resume="allow" if ids.get("trackio") else "never",
                auto_log_cpu=False, auto_log_gpu=False,
            )  # fmt: skip
        ids["trackio"] = name

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        with _quiet():
            self.run.finish()
        try:  # trackio's atexit hook finishes its "current" run again, printing after our result line
            from trackio import context_vars

            if context_vars.current_run.get() is self.run:
                context_vars.current_run.set(None)
        except (ImportError, AttributeError):
            pass


@contextlib.contextmanager
def _quiet() -> Any:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    for line in buf.getvalue().splitlines():
        if line.strip():
            log.info("trackio: %s", line.strip())


#: tracker name (the module it imports, and its extra ``grpo-parts[<name>]``) -> its class
TRACKERS: dict[str, Any] = {
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _MLflow,
    "trackio": _Trackio,
}


class Trackers:
    """The run's trackers: ``log(row)`` each metrics row, ``finish(status)`` once."""

    def __init__(self, names: list[str], run_dir: Path, name: str, config: dict[str, Any], config_yaml: str):
        self.trackers: dict[str, Any] = {}
        if not names:
            return
        ids_path = run_dir / IDS_FILE
        ids: dict[str, Any] = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        for n in names:
            try:
                self.trackers[n] = TRACKERS[n](run_dir, name, config, config_yaml, ids)
            except GRPOPartsError:
                raise
            except Exception as e:  # the library's own error (no login, server unreachable, ...)
                self.finish("failed")
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise GRPOPartsError(f"report_to: {n}: could not start a run: {first}") from None
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
        log.info("report_to: %s (run %r)", ", ".join(names), name)

    def log(self, row: dict[str, Any]) -> None:
        if not self.trackers:
            return
        metrics, step = numeric(row), int(row.get("step", 0))
        for t in self.trackers.values():
            t.log(metrics, step)

    def finish(self, status: str) -> None:
        trackers, self.trackers = self.trackers, {}
        for n, t in trackers.items():
            try:
                t.finish(status)
            except Exception as e:  # a tracker failing to close must not hide the run's own outcome
                log.warning("report_to: %s: could not close its run: %s", n, e)
