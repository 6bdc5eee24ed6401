"""``status.json``: what a run folder is doing, replaced atomically; its fields: docs/training.md, "The
run folder". A process killed with SIGKILL cannot update it, so :func:`read_status` adds ``stale``."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ...errors import GRPOPartsError
from .checkpoint import atomic_write_text

FILE = "status.json"


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, Linux), to tell a reused pid from the one recorded."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    pid = os.getpid()
    record = {"status": status, "time": time.time(), "pid": pid, "host": socket.gethostname()}
    record["pid_start"] = _start_time(pid)
    # no fsync: written every step, and a reader copes with a missing or old file after a crash
    atomic_write_text(run_dir / FILE, json.dumps({**record, **fields}) + "\n", sync=False)


def process_alive(pid: int, pid_start: int | None = None) -> bool:
    """Whether ``pid`` runs on this host (and, when ``pid_start`` is known, is the process recorded)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return pid_start is None or _start_time(pid) in (None, pid_start)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """``status.json`` of ``run_dir`` plus ``stale`` (for ``running``), or None if there is none."""
    try:
        record: dict[str, Any] = json.loads((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("status") == "running":
        if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
            record["stale"] = None
        elif record["pid"] == os.getpid():
            record["stale"] = True  # this process is not training it (it is about to)
        else:
            record["stale"] = not process_alive(record["pid"], record.get("pid_start"))
    return record


def check_not_running(run_dir: Path) -> dict[str, Any] | None:
    """Refuse to resume a run another process may still be writing; returns its status record."""
    record = read_status(run_dir)
    if record is None or record.get("status") != "running" or record["stale"]:
        return record
    pid, host = record.get("pid"), record.get("host")
    if record["stale"] is False:
        raise GRPOPartsError(
            f"resume: {str(run_dir)!r} is still running (pid {pid} on this host); stop it first "
            f"(Ctrl-C, or kill -TERM {pid}: it saves and exits)"
        )
    age = time.time() - float(record.get("time", 0))
    raise GRPOPartsError(
        f"resume: {str(run_dir / FILE)!r} says running as pid {pid} on host {host!r} "
        f"(last update {age / 60:.0f} min ago), which cannot be checked from {socket.gethostname()!r}; "
        f"if that process has stopped, delete {str(run_dir / FILE)!r} and resume again"
    )
