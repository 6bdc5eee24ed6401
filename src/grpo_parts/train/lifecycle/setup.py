"""Load the policy, tokenizer and task a :class:`~.config.TrainConfig` names, validating everything
before a run folder is created (so bad input never leaves a half-made run behind)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ... import compat
from ...errors import GRPOPartsError
from ...task.arithmetic import ArithmeticConfig, ArithmeticTask
from ...task.data import Task
from ...task.formats import load_records
from ...task.jsonl import DataConfig, JsonlTask
from ...task.reasoning import ReasoningConfig, ReasoningTask
from ...task.vision import VisionConfig, VisionTask
from ..config import DEFAULT_TASK, TrainConfig
from .threads import calibrate_threads

log = logging.getLogger("grpo_parts.train")

#: built-in task name -> its committed warm start (a folder under grpo_parts/assets)
#: the transformers release the built-in vision task needs (see load_setup)
VISION_TASK_MIN = (5, 0)
BUILTIN_MODELS = {"arithmetic": "tiny_adder", "reasoning": "tiny_reasoner", "vision": "tiny_counter"}


def builtin_model_path(task: str = "arithmetic") -> Path:
    """The committed warm-start checkpoint (transformers folder) of the built-in ``task``."""
    return Path(str(resources.files("grpo_parts") / "assets" / BUILTIN_MODELS[task]))


@dataclass
class Setup:
    policy: torch.nn.Module
    tokenizer: Any
    task: Task
    eos_token_ids: tuple[int, ...]
    ref_model: torch.nn.Module | None
    notes: list[str]
    #: a vision-language policy's processor (prompts with images go through it), else None
    processor: Any = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GRPOPartsError("device: 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(name)


@contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """transformers' progress bars (loading, saving) on or off inside the block, as before after it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, progress: bool = True
) -> tuple[torch.nn.Module, Any]:
    """A local transformers causal LM and its tokenizer (never downloads; ``progress=False``: without
    transformers' loading bar, which would otherwise be the one thing a quiet run prints)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not path.exists():
        raise GRPOPartsError(
            f"model: no such directory {str(path)!r} (expected a local transformers checkpoint)"
        )
    if not (path / "config.json").is_file():
        raise GRPOPartsError(
            f"model: {str(path)!r} has no config.json; expected a transformers checkpoint folder"
        )
    try:
        with hf_progress(progress):
            tok = _load_tokenizer(path) or AutoTokenizer.from_pretrained(path, local_files_only=True)
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            if getattr(config, "vision_config", None) is not None:
                raise GRPOPartsError(
                    f"model: {str(path)!r} is a vision-language model ({config.model_type}); grpo-parts "
                    "train trains one on image prompts (task.name=vision, or --data records with images); "
                    "the built-in text tasks need a causal LM: docs/training.md, 'The vision task'"
                )
            attn = compat.attn_implementation(compat.causal_lm_class(config))  # sdpa where supported
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True, attn_implementation=attn
            )
    except GRPOPartsError:
        raise  # already one line naming the field
    except (OSError, ValueError) as e:
        raise GRPOPartsError(f"model: could not load {str(path)!r}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = model.to(device)  # type: ignore[arg-type]
    return model.eval(), tok


def load_vlm(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    image_tokens: int | None = None,
) -> tuple[torch.nn.Module, Any]:
    """A local transformers vision-language model and its processor: ``AutoProcessor``'s files, or
    for a tiny model whose config names :data:`TINY_PROCESSOR` (the built-in warm start, and what a
    run exports from it) the offline :func:`~grpo_parts.tiny_vision.tiny_processor` rebuilt, its
    images resized to at most ``image_tokens`` when given."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from ...tiny_vision import TINY_PROCESSOR, tiny_processor

    try:
        with hf_progress(progress):
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            if getattr(config, "vision_config", None) is None:
                raise GRPOPartsError(
                    f"model: image prompts need a vision-language model, got {config.model_type} at {str(path)!r}"
                )
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
            tiny = getattr(config, TINY_PROCESSOR, None)
            processor = (
                tiny_processor(
                    model, **{**tiny, **({"max_image_tokens": image_tokens} if image_tokens else {})}
                )
                if tiny
                else AutoProcessor.from_pretrained(path, local_files_only=True)
            )
    except GRPOPartsError:
        raise
    except (OSError, ValueError) as e:
        raise GRPOPartsError(f"model: could not load {str(path)!r}: {e}") from None
    if not hasattr(processor, "image_processor"):
        raise GRPOPartsError(
            f"model: {str(path)!r} has no image processor (AutoProcessor found a {type(processor).__name__}); "
            "expected the processor's files beside the weights (processor.save_pretrained)"
        )
    processor.tokenizer.padding_side = "left"
    return model.to(device).eval(), processor  # type: ignore[arg-type]


def is_vlm(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` holds a vision-language model (a ``vision_config``)."""
    import json

    try:
        return "vision_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False  # load_model says what is wrong with the folder


def _load_tokenizer(path: Path) -> Any:
    """A folder whose tokenizer_config.json declares the generic ``PreTrainedTokenizerFast`` (the
    built-in character tokenizers) is loaded as exactly that: transformers 5 maps the model type
    (qwen2) to its own byte-level tokenizer class, whose pre-tokenizer drops spaces. None otherwise."""
    import json

    from transformers import PreTrainedTokenizerFast

    cfg = path / "tokenizer_config.json"
    try:
        declared = json.loads(cfg.read_text()).get("tokenizer_class") if cfg.is_file() else None
    except ValueError:
        return None
    if declared != "PreTrainedTokenizerFast" or not (path / "tokenizer.json").is_file():
        return None
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        for t in src if isinstance(src, (list, tuple)) else [src]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise GRPOPartsError(
            "model: the tokenizer and generation config define no EOS token; completions could never end"
        )
    return tuple(ids)


def with_rewards(task: Task, config: TrainConfig) -> Task:
    """``task`` with ``config.rewards`` as its training reward (imported and checked here)."""
    from ...task.rewards import RewardedTask, load_rewards

    first = task.train_problem(0)
    columns = [k for k in (first.columns or {"answer": first.answer}) if k != "prompt"]
    return RewardedTask(task, load_rewards(config.rewards, columns), config.steps)


def _data_config(config: TrainConfig) -> DataConfig:
    return config.task if isinstance(config.task, DataConfig) else DataConfig()


def _builtin_task(config: TrainConfig, builtin: bool, notes: list[str]) -> Task | None:
    """The built-in task of ``config.task`` (noted), or None for ``--data``, whose files are read
    and checked here, before the model loads (fast one-line errors; chat is rendered later)."""
    if config.data is not None:
        data_cfg = _data_config(config)
        for f in (config.data, config.eval_data):
            if f is not None:
                load_records(f, data_cfg.format, data_cfg.prompt_key, data_cfg.answer_key)
        return None
    if isinstance(config.task, ReasoningConfig):
        c = config.task
        reasoning = ReasoningTask(c, seed=config.seed)
        terms = lambda lo, hi: f"{lo}" if lo == hi else f"{lo}-{hi}"  # noqa: E731
        pool = (
            "a fresh problem every draw"
            if c.train_size is None
            else f"a pool of {c.train_size} problems, epoch after epoch"
        )
        notes.append(
            f"task: built-in reasoning (an instruction of {len(ReasoningTask.instruction)} tokens, then a sum of "
            f"{terms(c.min_terms, c.max_terms)} terms ({terms(c.long_min_terms, c.long_max_terms)} in one problem "
            f"of {c.long_every}); worked solutions reduce it line by line; {pool})"
        )
        return reasoning
    if isinstance(config.task, ArithmeticConfig):
        task = ArithmeticTask(config.task, seed=config.seed)
        notes.append(
            f"task: built-in chain addition ({config.task.operands} numbers in [0, {config.task.max_value}])"
        )
        if not builtin:
            notes.append("task: a custom --model on the built-in task uses its own tokenizer")
        return task
    return None


def _model_path(config: TrainConfig, builtin: bool) -> Path:
    """``--model``, or the built-in warm start of the task (for ``--data``, of the default task)."""
    builtin_task = config.task.name if config.task.name in BUILTIN_MODELS else DEFAULT_TASK
    path = builtin_model_path(builtin_task) if builtin else Path(config.model)  # type: ignore[arg-type]
    if builtin and not (path / "config.json").is_file():
        raise GRPOPartsError(
            f"model: the built-in warm start is missing at {str(path)!r}; run scripts/measure/"
            + ("vision_warm_start.py" if builtin_task == "vision" else f"warm_start.py --task {builtin_task}")
        )
    return path


def _data_task(config: TrainConfig, tok: Any, path: Path, notes: list[str]) -> Task:
    """The ``--data`` task, its prompts rendered with the model's tokenizer (noted)."""
    assert config.data is not None
    jt = JsonlTask.from_files(
        config.data, config.eval_data, config.eval_fraction, config.seed, _data_config(config), tok, str(path)
    )
    notes.append(
        f"task: {config.data} ({jt.format} format, {len(jt.train)} train / {len(jt.evals)} held-out)"
    )
    notes.extend(jt.notes)
    return jt


def _reference_model(config: TrainConfig, policy: torch.nn.Module) -> torch.nn.Module | None:
    """A frozen copy of the initial policy when KL is in the loss or in the reward, else None."""
    if not (config.loss.kl_coef > 0 or config.advantage.kl_coef > 0):
        return None
    return copy.deepcopy(policy).eval().requires_grad_(False)


def load_setup(config: TrainConfig) -> Setup:
    """Everything a run needs, validated. Raises :class:`GRPOPartsError` on bad input."""
    notes: list[str] = []
    builtin = config.model is None
    threads = config.threads or (1 if builtin else None)
    if threads:
        # 1 thread is fastest for the tiny built-in model (and far faster on a shared machine)
        torch.set_num_threads(threads)
    device = resolve_device(config.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
    task = _builtin_task(config, builtin, notes)
    torch.manual_seed(config.seed)
    path = _model_path(config, builtin)
    processor = None
    vision = config.task if isinstance(config.task, VisionConfig) else None
    if vision is not None and builtin and compat.transformers_version() < VISION_TASK_MIN:
        raise GRPOPartsError(
            f"task.name: 'vision' needs transformers >= {'.'.join(map(str, VISION_TASK_MIN))} for its warm start "
            f"(its Qwen2-VL takes logits_to_keep, and its offline processor needs no video processor, from then "
            f"on), got {'.'.join(map(str, compat.transformers_version()))}; or --model a VLM of your own"
        )
    if vision is not None or (config.data is not None and is_vlm(path)):
        image_tokens = None if vision is None else vision.image_tokens
        policy, processor = load_vlm(path, dtype, device, config.progress, image_tokens)
        tok = processor.tokenizer
    else:
        policy, tok = load_model(path, dtype, device, progress=config.progress)
    if vision is not None:
        task = VisionTask(vision, processor, seed=config.seed)
        notes.append(
            f"task: built-in vision (how many squares: 1-{vision.max_shapes} in a {vision.image_size}-pixel "
            f"image, {vision.image_tokens} image tokens per prompt)"
        )
    if config.data is not None:
        task = _data_task(config, processor or tok, path, notes)
    assert task is not None
    if config.rewards:
        task = with_rewards(task, config)
        notes.append(
            f"training reward: {getattr(task, 'grader_name', '')} (held-out accuracy: the task's grader)"
        )
    if not threads and device.type == "cpu":  # --model on the CPU: measured, not torch's default
        notes.append(
            calibrate_threads(policy, config.prompts_per_step * config.group_size, config.max_new_tokens)[1]
        )
    ref_model = _reference_model(config, policy)
    for n in notes:
        log.info(n)
    return Setup(policy, tok, task, eos_ids(policy, tok), ref_model, notes, processor)
