"""Checkpoints: ``checkpoints/step-NNNNNN/`` folders, written atomically; ``checkpoints/last`` names the newest.

``state.pt`` holds tensors and plain containers only, read with ``torch.load(weights_only=True)`` so
that resuming never unpickles arbitrary objects. A folder is written beside, fsynced and renamed, so a
kill leaves the previous checkpoint as it was; that one is kept too, for a checkpoint damaged later
(docs/training.md, "Stopping and resuming").
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...compat import portable_tokenizer_config
from ...errors import GRPOPartsError

FORMAT = 1
LAST = "last"
META = "checkpoint.json"
#: state entries written as safetensors (module weights): file stem -> keys leading to it in the state
WEIGHTS: dict[str, tuple[str, ...]] = {"policy": ("policy",), "draft": ("draft", "head")}
_STEP_DIR = re.compile(r"step-(\d+)")
#: files every run folder has from its first moment (how ``--resume`` tells a run from another folder)
RUN_FILES = ("config.yaml", "status.json", "metrics.jsonl")


class CorruptCheckpoint(GRPOPartsError):
    """One file of a checkpoint cannot be used: ``path`` and what is wrong with it."""

    def __init__(self, path: Path, what: str):
        self.path = path
        super().__init__(f"{path} {what}")


@dataclass
class Checkpoint:
    folder: Path
    step: int
    config: dict[str, Any]
    state: dict[str, Any] | None = None  # None until read in full


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to disk; any descriptor of the inode will do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, sync: bool = True) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file, never half;
    ``sync`` (fsync) so that a crash of the machine does too."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_path(path.parent)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final``, replacing an older one (a folder cannot be renamed
    over a non-empty one, so the old one steps aside first and is deleted after)."""
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _save_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors refuses tensors that share memory (tied embeddings): each is stored once and the
    other names are recorded as aliases in the file's metadata."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        shared = t.untyped_storage().data_ptr() in storages  # a partial overlap: store a copy
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t.to("cpu", copy=shared).contiguous()
    save_file(out, path, metadata={"aliases": json.dumps(aliases)})


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:  # type: ignore[no-untyped-call]
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for name, target in aliases.items():
        tensors[name] = tensors[target]
    return tensors


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``state`` without its module weights, and the weights by file stem."""
    rest = dict(state)
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for stem, keys in WEIGHTS.items():
        node = rest
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                break
            child = dict(node[k])  # copies along the path: the caller's state stays whole
            node[k] = child
            node = child
        else:
            if isinstance(node.get(keys[-1]), dict):
                weights[stem] = node.pop(keys[-1])
    return rest, weights


def _join(rest: dict[str, Any], weights: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    for stem, tensors in weights.items():
        node = rest
        for k in WEIGHTS[stem][:-1]:
            node = node.setdefault(k, {})
        node[WEIGHTS[stem][-1]] = tensors
    return rest


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    run_dir: Path, state: dict[str, Any], config_json: dict[str, Any], previous: int | None = None
) -> Path:
    """Write ``run_dir/checkpoints/step-NNNNNN/`` (atomically), point ``last`` at it, and delete the
    others but ``previous`` (this run's checkpoint before it, or the one it resumed from)."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = step_name(int(state["step"]))
    tmp = ckpt_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rest, weights = _split(state)
    for stem, tensors in weights.items():
        _save_weights(tmp / f"{stem}.safetensors", tensors)
    torch.save(rest, tmp / "state.pt")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    meta = {"format": FORMAT, "step": int(state["step"]), "config": config_json, "files": files}
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    replace_dir(tmp, ckpt_dir / name)
    atomic_write_text(ckpt_dir / LAST, name + "\n")
    _prune(ckpt_dir, {int(state["step"]), previous})
    return ckpt_dir / name


def checkpoint_steps(ckpt_dir: Path) -> dict[int, Path]:
    found = (_STEP_DIR.fullmatch(p.name) for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else iter(())
    return {int(m.group(1)): ckpt_dir / m.group(0) for m in found if m}


def _prune(ckpt_dir: Path, keep: set[int | None]) -> None:
    """Delete the checkpoints not in ``keep`` -- older ones, and later ones left by a timeline that a
    resume from an earlier checkpoint abandoned -- and ``.tmp``/``.old`` folders of a killed write."""
    stale = [p for s, p in checkpoint_steps(ckpt_dir).items() if s not in keep]
    for p in [*stale, *ckpt_dir.glob(".step-*")]:
        shutil.rmtree(p, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_meta(folder: Path) -> Checkpoint:
    """``checkpoint.json`` of ``folder``, with every file it lists present at its recorded size."""
    path = folder / META
    try:
        meta = json.loads(path.read_text())
        step, config, files = int(meta["step"]), dict(meta["config"]), dict(meta["files"])
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(path, f"is corrupt or truncated ({_first_line(e)})") from None
    if meta.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"has format {meta.get('format')!r}; this version reads {FORMAT}")
    for name, size in files.items():
        f = folder / name
        got = f.stat().st_size if f.is_file() else None
        if got != size:
            what = "is missing" if got is None else f"is truncated or damaged ({got} bytes, expected {size})"
            raise CorruptCheckpoint(f, what)
    return Checkpoint(folder, step, config)


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if m is None:  # (torch's message for garbage is about weights_only; the type says enough)
            why = type(e).__name__ if isinstance(e, pickle.UnpicklingError) else _first_line(e)
            raise CorruptCheckpoint(path, f"is corrupt or truncated ({why})") from None
        raise CorruptCheckpoint(
            path,
            f"holds a pickled {m.group(1)}, not only tensors and plain containers; refused "
            "(checkpoints are read with torch.load(weights_only=True))",
        ) from None


def read_checkpoint(folder: Path) -> Checkpoint:
    """The whole checkpoint in ``folder`` (on the CPU); :class:`CorruptCheckpoint` if any file is bad."""
    ckpt = read_meta(folder)
    state = _torch_load(folder / "state.pt")
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for stem in WEIGHTS:
        path = folder / f"{stem}.safetensors"
        if path.is_file():
            try:
                weights[stem] = _load_weights(path)
            except Exception as e:  # safetensors raises its own error types (header, size, dtype)
                raise CorruptCheckpoint(path, f"is corrupt or truncated ({_first_line(e)})") from None
    ckpt.state = _join(state, weights)
    return ckpt


def locate(path: Path) -> tuple[Path, Path]:
    """``(run folder, checkpoint folder)`` for ``--resume RUN_DIR`` (its newest checkpoint) or
    ``--resume RUN_DIR/checkpoints/step-NNNNNN`` (that one)."""
    if _STEP_DIR.fullmatch(path.name) and path.parent.name == "checkpoints":
        if not path.is_dir():
            raise GRPOPartsError(f"resume: no such checkpoint folder {str(path)!r}")
        return path.parent.parent, path
    if not path.is_dir():
        raise GRPOPartsError(f"resume: no such run folder {str(path)!r}")
    ckpt_dir = path / "checkpoints"
    steps = checkpoint_steps(ckpt_dir)
    pointer = ckpt_dir / LAST
    if not steps and not any((path / f).exists() for f in RUN_FILES):
        runs = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / "checkpoints").is_dir())
        inside = f"; it holds the runs {', '.join(runs)}: resume one of them" if runs else ""
        raise GRPOPartsError(
            f"resume: {str(path)!r} is not a run folder (no checkpoints/, {', '.join(RUN_FILES)}); expected "
            f"a folder grpo-parts train made{inside}"
        )
    if not steps:
        raise GRPOPartsError(
            f"resume: {str(path)!r} has no checkpoint (the run stopped before its first one); start a new run"
        )
    try:
        name = pointer.read_text().strip()
    except OSError:
        name = ""
    if not _STEP_DIR.fullmatch(name) or not (ckpt_dir / name).is_dir():
        raise CorruptCheckpoint(pointer, f"is missing or damaged (it names {name!r})")
    return path, ckpt_dir / name


def load_checkpoint(path: Path, full: bool = True) -> tuple[Path, Checkpoint]:
    """``(run folder, checkpoint)`` for ``--resume path``; ``full=False`` reads only ``checkpoint.json``.
    A damaged checkpoint is a one-line :class:`GRPOPartsError` naming the bad file and the newest
    earlier checkpoint that reads whole (with the command that resumes from it)."""
    run_dir = path
    try:
        run_dir, folder = locate(path)
        return run_dir, read_checkpoint(folder) if full else read_meta(folder)
    except CorruptCheckpoint as e:
        raise GRPOPartsError(f"resume: {e}; {_fallback(run_dir, e.path)}") from None


def _fallback(run_dir: Path, bad: Path) -> str:
    for step, folder in sorted(checkpoint_steps(run_dir / "checkpoints").items(), reverse=True):
        if bad.parent == folder:
            continue
        try:
            read_checkpoint(folder)
        except CorruptCheckpoint:
            continue
        return f"{folder} (step {step}) is intact: grpo-parts train --resume {folder}"
    return "no other checkpoint of this run is intact"


def export_model(run_dir: Path, policy: Any, tokenizer: Any) -> Path:
    """``run_dir/model/``: the policy as a ``save_pretrained`` folder that ``from_pretrained``, vLLM and
    ``--model`` load as they are; written beside and renamed, like a checkpoint."""
    final, tmp = run_dir / "model", run_dir / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    portable_tokenizer_config(tmp)  # loadable by every transformers release in our range (4.x too)
    replace_dir(tmp, final)
    return final
