"""``grpo-parts train --compare`` / ``grpo-parts bench e2e``: reference parts vs optimized parts.

Both runs use the same config, seed, data stream and held-out set; only ``parts`` differs. They run
one after the other in this process (reference first), into ``<run>/reference`` and
``<run>/optimized``; ``<run>/compare.{json,md,png}`` report time to the target held-out accuracy
(training wall time, evaluation excluded), final accuracy, and both curves against wall time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import GRPOPartsError
from .config import TrainConfig
from .report import write_compare
from .run import default_name, train


def compare(
    config: TrainConfig, out_dir: Path | None = None, json_path: Path | None = None
) -> dict[str, Any]:
    out_dir = out_dir or Path(config.out_dir) / (config.name or f"compare-{default_name()}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GRPOPartsError(f"name: folder {str(out_dir)!r} already exists; choose another --name")
    configs = {"reference": config.with_reference_parts(), "optimized": config}
    rows: dict[str, list[dict[str, Any]]] = {}
    described: dict[str, str] = {}
    for arm, cfg in configs.items():
        res = train(cfg, run_dir=out_dir / arm, title=f"{arm} parts")
        rows[arm] = res.rows
        described[arm] = _parts_line(out_dir / arm)
    result = write_compare(out_dir, rows, config.target_accuracy, {"parts": described, "seed": config.seed})
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    result["markdown"] = (out_dir / "compare.md").read_text() + f"\nFolder: {out_dir}\n"
    return result


def _parts_line(run_dir: Path) -> str:
    for line in (run_dir / "report.md").read_text().splitlines():
        if "parts:" in line:
            return line.split("parts:", 1)[1].strip()
    return "-"
