"""The one filter seam behind verl: :class:`FilteringReplayBuffer`, verl's sync ``ReplayBuffer`` with a
grpo_parts CompletionFilter (and refill), through verl's custom-sampler seam (:func:`hydra_overrides`) or
around verl's own buffer (trainer mode ``grpo_parts_sync``). ``sample`` returns only the kept rows
(:mod:`.kv_filter`) and logs the rollout servers' counters (``parts/sampler/*``). docs/adapters/verl.md."""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from grpo_parts.counters import framework_keys
from grpo_parts.errors import GRPOPartsError

from .advantage import remember_full_groups
from .filtering import VERL_KEYS, FilterOptions
from .kv_filter import check_weighted, filter_kv_batch
from .rollout import sampler_metrics
from .skipping import VerlSkipStage

#: ``trainer.v1.sampler.sampler_kwargs`` key holding :class:`~.filtering.FilterOptions`
KWARGS_KEY = "grpo_parts_filter"
PATH = "pkg://grpo_parts_adapters.verl.sampler"


def options_from_sampler_kwargs(sampler_kwargs: Any) -> FilterOptions | None:
    node = (sampler_kwargs or {}).get(KWARGS_KEY) if sampler_kwargs is not None else None
    if node is None:
        return None
    raw = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    if not isinstance(raw, dict) or raw.get("name") in (None, "", "keep_all"):
        return None
    return FilterOptions(**{str(k): v for k, v in raw.items()})


class FilteringReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer`` + a grpo_parts CompletionFilter on every training sample, built by
    verl from ``trainer.v1.sampler.custom_sampler`` or put :meth:`around` verl's own buffer by the
    trainer mode ``grpo_parts_sync``."""

    #: the trainer mode's prompt skipping stage (None: every prompt rolled out)
    grpo_parts_skip: VerlSkipStage | None = None
    #: hand the kept groups' full-group advantages to ``grpo_parts_grpo`` (the custom-sampler seam)
    remembers_full_groups = True

    def __init__(self, *args: Any, store: Any = tq, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opts = options_from_sampler_kwargs(self.sampler_kwargs)
        if opts is not None and opts.prompt_skip != "none":
            raise ValueError(
                f"grpo_parts_filter.prompt_skip={opts.prompt_skip!r}: the sampler seam sees prompts only after "
                "verl submitted them; use trainer.v1.trainer_mode=grpo_parts_sync with +grpo_parts.filter.prompt_skip"
            )
        self._use(opts, None if opts is None else opts.build(), store)

    @classmethod
    def around(
        cls,
        inner: ReplayBuffer,
        options: FilterOptions,
        filt: Any,
        skip: VerlSkipStage | None,
        store: Any = tq,
    ) -> FilteringReplayBuffer:
        """verl's own sync buffer ``inner`` (its state as verl built it) sampling through the filter."""
        if type(inner) is not ReplayBuffer:
            raise GRPOPartsError(
                f"trainer.v1.sampler.custom_sampler: the trainer mode filters verl's own ReplayBuffer, got "
                f"{type(inner).__name__}; drop the custom sampler"
            )
        buffer = cls.__new__(cls)
        buffer.__dict__.update(inner.__dict__)
        buffer._use(options, filt, store)
        buffer.grpo_parts_skip, buffer.remembers_full_groups = skip, False
        return buffer

    def _use(self, opts: FilterOptions | None, filt: Any, store: Any) -> None:
        self.grpo_parts_filter_options, self.grpo_parts_filter, self._store = opts, filt, store
        if opts is not None and opts.refill_rounds and self.refill_fn is None:
            raise ValueError(
                f"grpo_parts_filter.refill_rounds={opts.refill_rounds}: verl gave this sampler no refill_fn"
            )
        if filt is not None:
            check_weighted(filt, opts)  # dppo: a loss verl keeps unbiased, no refill

    def _sampler_metrics(self, batch: KVBatchMeta) -> dict[str, float]:
        """The rollout backend's counters (``rollout.name=grpo_parts``) carried by the samples."""
        if not batch.keys:
            return {}
        try:
            data = self._store.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"]
            )
            extras = list(data["extra_fields"]) if "extra_fields" in data.keys() else []
        except Exception:  # another rollout backend stores no such field: nothing to count
            return {}
        return sampler_metrics(extras)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        batch, metrics = super().sample(
            global_steps=global_steps, partition_id=partition_id, batch_size=batch_size
        )
        opts, filt = self.grpo_parts_filter_options, self.grpo_parts_filter
        if partition_id == "val":
            return batch, metrics
        metrics.update(self._sampler_metrics(batch))
        if opts is None or filt is None:
            return batch, metrics

        def more(n_prompts: int) -> KVBatchMeta | None:
            # verl's refill_fn submits whole dataloader fetches of data.gen_batch_size
            g = opts.refill_granularity
            n = -(-n_prompts // g) * g
            assert self.refill_fn is not None
            self.refill_fn(n)
            b, m = super(FilteringReplayBuffer, self).sample(
                global_steps=global_steps, partition_id=partition_id, batch_size=n
            )
            metrics.update(framework_keys("refill", m))
            return b

        kept, fmetrics, full = filter_kv_batch(
            batch, filt, opts, store=self._store, more=more if opts.refill_rounds else None,
            return_groups=True, skip=self.grpo_parts_skip,
        )  # fmt: skip
        if self.remembers_full_groups:
            remember_full_groups(full, norm_adv_by_std=opts.norm_adv_by_std)
        metrics.update(fmetrics)
        return kept, metrics


def buffer_overrides() -> list[str]:
    """verl's custom-sampler keys naming :class:`FilteringReplayBuffer`; alone (no filter) it only
    logs the rollout backend's counters (``parts/sampler/*``)."""
    return [
        f"trainer.v1.sampler.custom_sampler.path={PATH}",
        "trainer.v1.sampler.custom_sampler.name=FilteringReplayBuffer",
    ]


def hydra_overrides(name: str = "cppo", kwargs: dict[str, Any] | None = None, **options: Any) -> list[str]:
    """The Hydra overrides of ``python -m verl.trainer.main_ppo`` that switch the filter on under
    verl's default trainer; ``options`` are further :class:`~.filtering.FilterOptions` keys, and the
    keys of ``filtering.VERL_KEYS`` default to Hydra interpolations of verl's own."""
    for key, path in VERL_KEYS.items():
        options.setdefault(key, "${" + path + "}")
    FilterOptions(
        name=name, kwargs=dict(kwargs or {}), **{k: v for k, v in options.items() if "$" not in str(v)}
    )
    node = f"+trainer.v1.sampler.sampler_kwargs.{KWARGS_KEY}"
    out = ["algorithm.adv_estimator=grpo_parts_grpo", *buffer_overrides(), f"{node}.name={name}"]
    out += [f"{node}.kwargs.{k}={v}" for k, v in (kwargs or {}).items()]
    out += [f"{node}.{k}={v}" for k, v in options.items()]
    return out
