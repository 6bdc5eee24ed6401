"""Training configuration: one pydantic model, loadable from YAML and overridable from the CLI.
Every value is validated on construction, so a bad value fails before anything is written to disk."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..core import AdvantageConfig, LossConfig
from ..errors import GRPOPartsError
from ..parts_config import DOOR_DEFAULTS, PartsConfig
from ..skip.protocol import prompt_skip_reasons
from ..task.arithmetic import ArithmeticConfig
from ..task.jsonl import DataConfig
from ..task.reasoning import ReasoningConfig
from ..task.rewards import parse_reward_spec
from ..task.vision import VisionConfig
from .skip_defaults import apply_skip_defaults

#: The built-in task a config without ``task.name`` trains on.
DEFAULT_TASK = "reasoning"
#: Fields whose default depends on the built-in task (a value given in the config wins).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "arithmetic": {},
    # GRPO lifts the warm start's habit within a few steps (docs/results.md, "End to end")
    "reasoning": {"max_new_tokens": 320, "steps": 15, "eval_every": 3},
    # --data (task.name: data) keeps the defaults it had before it had a task section of its own
    "data": {"max_new_tokens": 320, "steps": 15, "eval_every": 3},
    # the answer is one token (the sampler for image prompts: step.parts.build_parts)
    "vision": {"max_new_tokens": 4, "steps": 150, "eval_every": 10, "lr": 1e-3, "target_accuracy": 0.8},
}

#: The reference implementation of each part (the plain GRPO path).
REFERENCE_PARTS: dict[str, Any] = {
    "sampler": "reference",
    "draft": None,
    "attention": "reference",
    "filter": "keep_all",
    "prompt_skip": "none",
}


def train_parts(data: Any) -> Any:
    """``parts`` with this door's defaults (``DOOR_DEFAULTS["train"]``: the optimized parts) under the
    given fields, before the field validates it as the shared :class:`PartsConfig`."""
    if isinstance(data, PartsConfig):
        return PartsConfig.for_door("train", data)
    if not isinstance(data, dict):
        return data
    return {**DOOR_DEFAULTS["train"], **data}  # validated as the field (errors name parts.*)


class TrainConfig(BaseModel):
    """A GRPO run. ``model``/``data`` = None means the built-in task and its committed warm start.
    Every field's meaning: docs/training.md, "Every field" (tests/train/test_docs_fields.py checks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = None  # default: a timestamp
    out_dir: Path = Path("runs")
    seed: int = Field(0, ge=0)
    steps: int = Field(40, ge=1, le=10_000_000)
    prompts_per_step: int = Field(16, ge=1, le=1_000_000)
    group_size: int = Field(8, ge=2, le=4096)
    max_new_tokens: int = Field(28, ge=1, le=1_000_000)
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    lr: float = Field(1e-4, gt=0.0, le=1.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"  # TRL's default
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0)
    minibatches: int = Field(1, ge=1, le=1024)
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    # the one parts configuration of every door, with this door's defaults: the optimized parts
    parts: PartsConfig = Field(default_factory=lambda: PartsConfig.for_door("train"))
    task: ArithmeticConfig | ReasoningConfig | DataConfig | VisionConfig = Field(
        default_factory=ReasoningConfig, discriminator="name"
    )
    rewards: list[str] = Field(default_factory=list)
    stop_after_flat: int = Field(3, ge=0)
    samples_per_eval: int = Field(4, ge=0, le=10_000)
    eval_every: int = Field(5, ge=1)
    eval_temperature: float = Field(0.0, ge=0.0)
    checkpoint_every: int = Field(10, ge=0)
    target_accuracy: float = Field(0.6, gt=0.0, le=1.0)
    time_limit_s: float | None = Field(None, gt=0.0)
    model: Path | None = None
    data: Path | None = None
    eval_data: Path | None = None
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = Field(None, ge=1)
    progress: bool = True
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(default_factory=list)
    project: str = Field("grpo-parts", min_length=1)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: Any) -> Any:
        """TRL's forms: ``"none"``, ``"wandb"``, ``"wandb,tensorboard"`` or a list; duplicates dropped."""
        items = [x.strip() for x in v.split(",")] if isinstance(v, str) else v
        if not isinstance(items, list):
            return v
        if "none" in items:
            if len(items) > 1:
                raise ValueError(f"'none' means no tracker, got it with {[x for x in items if x != 'none']}")
            return []
        return list(dict.fromkeys(items))

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:
        """``task.name`` is always recorded (so a saved config keeps its task if the default changes),
        and the fields in :data:`TASK_DEFAULTS` take the task's default when not given."""
        if not isinstance(data, dict):
            return data
        task = {} if data.get("task") is None else data["task"]
        if isinstance(task, dict):
            task = {"name": "data" if data.get("data") is not None else DEFAULT_TASK, **task}
            data = {**data, "task": task}
            for key, value in TASK_DEFAULTS.get(str(task["name"]), {}).items():
                data.setdefault(key, value)
        data = apply_skip_defaults(data, cls.model_fields["max_new_tokens"].default)
        if "parts" in data:
            data = {**data, "parts": train_parts(data["parts"])}
        return data

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, specs: list[str]) -> list[str]:
        for spec in specs:
            parse_reward_spec(spec)
        return specs

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.eval_data is not None and self.data is None:
            raise ValueError("eval_data: only used together with data")
        if isinstance(self.task, DataConfig) and self.data is None:
            raise ValueError(
                "task.name: 'data' reads --data, got no data; expected --data FILE or a built-in task"
            )
        if self.advantage.kl_coef > 0 and self.advantage.kl_placement == "token":
            # per-token advantages [N, T] have no single value for a CompletionFilter to rank
            raise ValueError(
                "advantage.kl_placement: 'token' is not supported by grpo-parts train, use 'sequence'"
            )
        if self.loss.correction.level != "off" and self.old_logprobs == "sampler":
            # the correction weight is pi_old / pi_sampler: with the sampler's log-probs as old it is 1
            raise ValueError(
                "loss.correction.level: needs old_logprobs='recompute', got old_logprobs='sampler'"
            )
        if self.parts.group_rows is False:
            raise ValueError(
                "parts.group_rows: grpo-parts train always trains each prompt's rows together, got False; "
                "expected null or true"
            )
        if self.parts.prompt_skip != "none":
            # the trainer's sampler emits >= 1 token per completion: no row is empty (skip_minibatches checks)
            reasons = prompt_skip_reasons(self.advantage, self.loss, empty_rows=False)
            if reasons:
                raise ValueError(f"parts.prompt_skip: {self.parts.prompt_skip!r} with {reasons[0]}")
        if self.minibatches > self.prompts_per_step:
            raise ValueError(
                f"minibatches: expected <= prompts_per_step={self.prompts_per_step} (whole groups per minibatch), "
                f"got {self.minibatches}"
            )
        return self

    def with_reference_parts(self) -> TrainConfig:
        return self.model_copy(update={"parts": PartsConfig(**REFERENCE_PARTS)})


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise GRPOPartsError(f"--set {dotted}: {k!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", yaml-parsed value)``."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise GRPOPartsError(f"--set: expected KEY=VALUE (e.g. parts.filter=keep_all), got {item!r}")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise GRPOPartsError(
            f"--set {item}: the value is not valid YAML ({_yaml_problem(e, False)}); expected a YAML value, "
            "e.g. 0.01, keep_all, '{pruning_rate: 0.5}' (quote it in the shell)"
        ) from None


def _yaml_problem(e: Exception, where: bool = True) -> str:
    """PyYAML's error as one line: what is wrong and (``where``) at which line and column."""
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if where and mark is not None else ""
    return f"{at}{problem}"


def load_config(
    path: Path | str | None = None, overrides: dict[str, Any] | None = None, sets: list[str] | None = None
) -> TrainConfig:
    """Build a :class:`TrainConfig` from an optional YAML file, then dotted overrides (later wins);
    validation errors become :class:`GRPOPartsError` naming the field, the value and the rule."""
    import yaml

    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise GRPOPartsError(f"config: no such file {str(p)!r}")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            what = _yaml_problem(e) if isinstance(e, yaml.YAMLError) else "not UTF-8 text"
            raise GRPOPartsError(
                f"config: {str(p)!r} is not valid YAML ({what}); expected a YAML mapping of TrainConfig fields"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise GRPOPartsError(
                f"config: expected a YAML mapping in {str(p)!r}, got {type(loaded).__name__}"
            )
        tree = loaded or {}
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    for item in sets or []:
        _set_dotted(tree, *parse_override(item))
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        lines = [_error_line(err) for err in e.errors()]
        if len(lines) == 1:  # the usual case: one line, as for every other user error
            raise GRPOPartsError(f"invalid training config: {lines[0]}") from None
        raise GRPOPartsError("invalid training config:\n  " + "\n  ".join(lines)) from None


def _error_line(err: Any) -> str:
    """One pydantic error as ``field: message, got value``. Our validators' messages (``ValueError``s,
    prefixed "Value error, ") start with their field relative to the section that raised them, so they
    get the section's path in front: ``advantage`` + ``norm: ...`` -> ``advantage.norm: ...``."""
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"])
    if err.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")
        head = re.match(r"[\w.]+(?=: )", msg)
        if head:
            if not loc or head.group() == loc or head.group().startswith(loc + "."):
                return msg
            return f"{loc}.{msg}"
    got = f", got {err['input']!r}" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"{loc or 'config'}: {msg}{got}"


def dump_config(config: TrainConfig) -> str:
    import yaml

    return str(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
