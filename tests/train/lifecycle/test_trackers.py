"""``report_to`` (issue 23 item 4): each tracker gets every numeric key of every metrics.jsonl row at
its step, and the config; the tests read the values back offline, from what each library wrote:
TensorBoard event files, W&B offline mode (the run's ``.wandb`` log of protobuf records), an MLflow
file store, Trackio's local database. A test skips only when its library is absent (a core venv
without the extras); scripts/ci/install-dev.sh installs all four, so in the dev suite and CI they run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import refused, snapshot

from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import RunResult, train
from grpo_parts.train.lifecycle.trackers import TRACKERS, numeric


def _run(name: str, tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, **extra: Any) -> RunResult:
    over = tiny_overrides(tiny_model_dir, tmp_path / "runs", name=f"tr-{name}", report_to=[name], **extra)
    over.update({"steps": 3, "eval_every": 2, "lr": 3e-4, "project": f"grpo-parts-test-{name}"})
    return train(load_config(overrides=over).with_reference_parts())


def _expected(run: RunResult) -> dict[int, dict[str, float]]:
    """What every tracker must hold: per step, every numeric key of that metrics.jsonl row."""
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {int(r["step"]): numeric(r) for r in rows}
    assert len(out) == 4 and all(out.values()) and {"reward", "loss", "eval_accuracy"} <= set(out[2])
    return out


def _same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for step, metrics in want.items():
        assert set(got[step]) == set(metrics), (step, set(metrics) ^ set(got[step]))
        for k, v in metrics.items():
            assert math.isclose(got[step][k], v, rel_tol=rel, abs_tol=0.0), (step, k, got[step][k], v)


def test_tensorboard(tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run("tensorboard", tiny_model_dir, tmp_path, tiny_overrides)
    ea = EventAccumulator(str(run.run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in ea.Tags()["scalars"]:
        for ev in ea.Scalars(tag):
            got.setdefault(ev.step, {})[tag] = ev.value
    _same(got, _expected(run), rel=1e-6)  # TensorBoard stores scalars as float32
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr: 0.0003" in text and "report_to:\n- tensorboard" in text


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log blocks of 32 KiB holding chunks (crc32c, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, chunk = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last
            rec = pb.Record()
            rec.ParseFromString(chunk)
            records.append(rec)
            chunk = b""
        if kind == 0 and length == 0:
            break
    return records


def test_wandb_offline(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run = _run("wandb", tiny_model_dir, tmp_path, tiny_overrides)
    run_id = json.loads((run.run_dir / "trackers.json").read_text())["wandb"]
    (log,) = list((run.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    # wandb-core writes the log from its own service process; run.finish() returning does not mean
    # the writer has flushed (CI once read only the records before the history). teardown() waits for
    # the service to exit, and the log is read once it holds the run's exit record.
    import wandb

    wandb.teardown()
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(log)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        assert time.monotonic() < deadline, kinds
        time.sleep(0.5)
    got: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            got[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind in ("run", "config"):  # the config given to wandb.init, then any updates
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({i.key: json.loads(i.value_json) for i in updates})
    _same(got, _expected(run))
    assert (
        config["lr"] == 3e-4
        and config["report_to"] == ["wandb"]
        and config["parts"]["sampler"] == "reference"
    )


@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An MLflow file store under ``tmp_path`` (``MLFLOW_TRACKING_URI``) for the run to log into."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return uri


def test_mlflow_file_store(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, mlflow_uri: str
) -> None:
    from mlflow.tracking import MlflowClient

    run = _run("mlflow", tiny_model_dir, tmp_path, tiny_overrides)
    run_id = json.loads((run.run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=mlflow_uri)
    want = _expected(run)
    got: dict[int, dict[str, float]] = {}
    for key in {k for m in want.values() for k in m}:
        for m in client.get_metric_history(run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    _same(got, want)
    mrun = client.get_run(run_id)
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "tr-mlflow"
    assert mrun.data.params["lr"] == "0.0003" and mrun.data.params["parts.sampler"] == "reference"
    assert "lr: 0.0003" in Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trackio reads TRACKIO_DIR once, when it is first imported: set it before that, for the session."""
    path = tmp_path_factory.mktemp("trackio")
    os.environ["TRACKIO_DIR"] = str(path)
    return path


def test_trackio_local(
    trackio_dir: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    tiny_overrides: Any,
    capsys: pytest.CaptureFixture,
) -> None:
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    run = _run("trackio", tiny_model_dir, tmp_path, tiny_overrides)
    assert "Trackio" not in capsys.readouterr().out  # its banner goes to the log, not our stdout
    logs = SQLiteStorage.get_logs("grpo-parts-test-trackio", "tr-trackio")
    got = {int(r["step"]): {k: v for k, v in r.items() if k not in ("step", "timestamp")} for r in logs}
    _same(got, _expected(run))
    config = SQLiteStorage.get_run_config("grpo-parts-test-trackio", "tr-trackio")
    assert config is not None and config["lr"] == 3e-4
    # (trackio may have been imported before the fixture set TRACKIO_DIR: its database is where trackio says)
    assert SQLiteStorage.get_project_db_path("grpo-parts-test-trackio").is_file()


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_a_missing_tracker_library_is_one_line_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == name else real(m, *a))
    (tmp_path / "runs").mkdir()
    before = snapshot(tmp_path)
    both = f"{name},trackio" if name != "trackio" else name  # the first missing one in the order given
    argv = ["--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "runs"), "--report-to", both]
    refused(
        capsys,
        argv,
        f"report_to: {name!r} needs the",
        f"pip install -e '.[{name}]' in a checkout, or pip install 'grpo-parts[{name}]'",
    )
    assert snapshot(tmp_path) == before


def test_report_to_forms() -> None:
    assert load_config(overrides={"report_to": "none"}).report_to == []
    assert load_config(overrides={"report_to": "wandb, tensorboard,wandb"}).report_to == [
        "wandb",
        "tensorboard",
    ]
    assert load_config(sets=["report_to=[mlflow, trackio]"]).report_to == ["mlflow", "trackio"]
    with pytest.raises(Exception, match="'none' means no tracker"):
        load_config(overrides={"report_to": "none,wandb"})
    with pytest.raises(Exception, match="report_to.0: Input should be 'tensorboard'"):
        load_config(overrides={"report_to": ["comet"]})


def test_a_resumed_run_logs_into_the_same_tracker_run(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, mlflow_uri: str
) -> None:
    from mlflow.tracking import MlflowClient

    from grpo_parts.train.lifecycle.run import resume_config

    first = _run("mlflow", tiny_model_dir, tmp_path, tiny_overrides)
    run_id = json.loads((first.run_dir / "trackers.json").read_text())["mlflow"]
    resumed = train(resume_config(first.run_dir, {"steps": 5}), run_dir=first.run_dir, resume=True)
    assert json.loads((resumed.run_dir / "trackers.json").read_text())["mlflow"] == run_id
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1, 2, 3, 4, 5]
    exp = client.get_experiment_by_name("grpo-parts-test-mlflow")
    assert exp is not None and len(client.search_runs([exp.experiment_id])) == 1
    assert client.get_run(run_id).info.status == "FINISHED"
