"""CompletionFilter in OpenRLHF: a ``RemoteExperienceMaker`` that computes GRPO advantages with
:func:`grpo_parts.core.group_advantages`, filters completions and refills through the samples generator.
With rewards from functions, remote RMs or agents the filter runs before the old-policy / reference
forwards (CPPO's saving); with a reward model, after them. ``keep_all`` equals OpenRLHF's ``group_norm``.
docs/adapters/openrlhf.md, "CompletionFilter" and "Prompt skipping"."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Literal

import ray
import torch
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

from grpo_parts.build import build_filter
from grpo_parts.core import AdvantageConfig, group_advantages, group_stats
from grpo_parts.counters import KEPT_FRACTION, REFILL_PROMPTS, ROUNDED_ROWS, WEIGHTED_ROWS, PartCounters
from grpo_parts.doors.weights import weighted_rows
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.filter.rounding import batch_multiple, rank_shares, round_kept_rows
from grpo_parts.types import ScoredBatch

from .config import ADVANTAGE_CONFIGS, skip_reasons, weighted_filter_reasons

logger = logging.getLogger(__name__)

#: per-sample scalar advantage, and weight x kept / rolled-out rows (a weighted filter), in Experience.info
_ADV_KEY = "grpo_parts_advantage"
_W_KEY = "grpo_parts_weight"


class NothingKept(GRPOPartsError):
    """The filter kept no completion of this step (e.g. every group had equal rewards): the
    trainer skips the update instead of training on an empty batch."""


def group_index_of(samples: list[Experience], group_size: int) -> torch.Tensor:
    """OpenRLHF's grouping: consecutive runs of ``n_samples_per_prompt`` samples share a prompt
    (its ``group_norm`` reshapes rewards to ``[-1, G]``). Checked against ``Experience.prompts``."""
    n = sum(len(s.sequences) for s in samples)
    if group_size < 1 or n % group_size:
        raise GRPOPartsError(
            f"rollout samples: expected a multiple of n_samples_per_prompt={group_size} rows, got {n}"
        )
    prompts = _row_prompts(samples)
    if len(prompts) == n:
        for g in range(n // group_size):
            run = prompts[g * group_size : (g + 1) * group_size]
            if any(p != run[0] for p in run):
                raise GRPOPartsError(
                    f"rollout samples: rows {g * group_size}..{(g + 1) * group_size - 1} should share one prompt "
                    f"(OpenRLHF groups consecutive samples), got {len(set(run))} different prompts"
                )
    return torch.arange(n // group_size).repeat_interleave(group_size)


class GRPOPartsExperienceMaker(RemoteExperienceMaker):
    """``RemoteExperienceMaker`` with a grpo_parts ``CompletionFilter`` (default keep-all = plain
    OpenRLHF). ``samples_generator`` / ``generate_kwargs`` refill up to ``refill_rounds`` extra rounds;
    ``counters`` counts filter calls; ``last_info`` holds the last step's filter diagnostics."""

    def __init__(
        self,
        *args: Any,
        filter: Any = None,
        samples_generator: Any = None,
        generate_kwargs: dict[str, Any] | None = None,
        refill_rounds: int = 0,
        kept_rounding: str = "up",
        counters: PartCounters | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.kept_rounding = kept_rounding
        if refill_rounds > 0 and not hasattr(samples_generator, "generate_prompts"):
            raise GRPOPartsError(
                "refill_rounds > 0 needs the trainer's samples generator to be a GRPOPartsSamplesGenerator"
            )
        if self.advantage_estimator not in ADVANTAGE_CONFIGS:
            raise GRPOPartsError(
                f"algo.advantage.estimator: grpo_parts supports {sorted(ADVANTAGE_CONFIGS)}, "
                f"got {self.advantage_estimator!r}"
            )
        # clip as OpenRLHF's compute_reward will, so the filter ranks the advantage the loss sees
        clip = getattr(self.args.reward, "clip_range", None)
        base = ADVANTAGE_CONFIGS[self.advantage_estimator].model_dump()
        self.adv_config = AdvantageConfig.model_validate(
            {**base, "reward_clip": tuple(clip) if clip else None}
        )
        self.filter = build_filter("keep_all" if filter is None else filter)
        reasons = weighted_filter_reasons(self.filter, self.args, refill_rounds)
        if reasons:
            raise NotSupportedError(f"--grpo_parts.filter {self.filter.name}", reasons)
        self.samples_generator = samples_generator
        self.generate_kwargs = dict(generate_kwargs or {})
        self.refill_rounds = refill_rounds
        self.counters = counters if counters is not None else PartCounters({"filter": "calls"}, logger)
        self.counters.track("filter")
        self.last_info: dict[str, float] = {}
        self.last_skip_info: dict[str, float] = {}
        self.rounded_rows = 0  # rows the last step's rounding added (> 0) or dropped (< 0)
        #: the prompt skipping stage of the samples generator (None: every prompt rolled out)
        self.skip_stage = getattr(samples_generator, "skip_stage", None)
        skip_refused = skip_reasons(self.args, refill_rounds) if self.skip_stage is not None else []
        if skip_refused:
            raise NotSupportedError("--grpo_parts.prompt_skip", skip_refused)

    @property
    def group_size(self) -> int:
        return int(self.args.rollout.n_samples_per_prompt)

    @property
    def dp_size(self) -> int:
        """The actor's data-parallel ranks, as OpenRLHF counts them (``split_rollout_samples``)."""
        a, ds = self.args.actor, self.args.ds
        return int(a.num_nodes * a.num_gpus_per_node // ds.ring_attn_size // ds.tensor_parallel_size)

    @property
    def batch_multiple(self) -> int:
        """Kept rows are rounded to this: whole ``--train.batch_size`` optimizer steps, which also
        gives every rank the same number of micro-batches (OpenRLHF's ``accumulated_gradient``)."""
        return batch_multiple(int(self.args.train.batch_size), self.dp_size)

    def score(self, samples: list[Experience]) -> ScoredBatch:
        """Shape the rewards as OpenRLHF does (>= float32, length penalties; in place, once) and
        compute every row's advantage on its full group."""
        for s in samples:
            s.rewards = s.rewards.to(torch.promote_types(s.rewards.dtype, torch.float32))
        apply_length_penalties(samples, self.args)
        rewards = torch.cat([s.rewards for s in samples])
        gi = group_index_of(samples, self.group_size)
        adv = group_advantages(rewards, gi, self.adv_config)
        std = group_stats(rewards, gi, unbiased=True)[2][gi]  # logged like OpenRLHF's group_reward_std
        lengths = (
            torch.cat([s.response_length for s in samples]).long()
            if samples[0].response_length is not None
            else None
        )
        sizes = [len(s.sequences) for s in samples]
        for s, a, sd in zip(samples, adv.split(sizes), std.split(sizes)):
            s.info[_ADV_KEY] = a
            s.info["group_reward_std"] = sd
        return ScoredBatch(rewards, adv, gi, lengths)

    def _select(self, samples: list[Experience], refill: bool = True) -> list[Experience]:
        """Filter (and, with ``refill``, refill) single-sample experiences whose rewards are known."""
        scored = self.score(samples)
        target = len(samples)
        can_refill = refill and self.refill_rounds > 0 and self.samples_generator is not None
        if not can_refill:
            res = self.filter.select(scored, target_size=None)
            self.counters.ran("filter")
            skipping = self._observe_skip(samples, scored)
            (kept,) = self._round([scored], [res.kept], weighted=res.weights is not None or skipping)
            self.last_info = {
                KEPT_FRACTION: kept.numel() / max(target, 1),
                REFILL_PROMPTS: 0.0,
                ROUNDED_ROWS: float(self.rounded_rows),
            }
            if res.weights is not None:
                self.last_info[WEIGHTED_ROWS] = float(_weigh(samples, res.kept, res.weights, kept))
            if self.skip_stage is not None:
                _weigh_prompts(samples, kept, self.skip_stage.row_weights(_row_prompts(samples)))
            return [samples[i] for i in kept.tolist()]
        from grpo_parts.filter.refill import Refiller, Round

        first = [True]

        def produce(n: int) -> Any:
            if first[0]:
                first[0] = False
                return Round(samples, scored, len(samples) // self.group_size)
            more = self._generate_more(n)
            return Round(more, self.score(more), len(more) // self.group_size) if more else None

        refiller = Refiller(
            target_size=target,
            initial_prompts=len(samples) // self.group_size,
            max_rounds=1 + self.refill_rounds,
        )
        out = refiller.fill(self.filter, produce)
        self.counters.ran("filter", n=out.rounds)
        rounded = self._round([s.round.scored for s in out.selections], [s.kept for s in out.selections])
        self.last_info = {
            **out.info,
            REFILL_PROMPTS: float(out.prompts_used - len(samples) // self.group_size),
            ROUNDED_ROWS: float(self.rounded_rows),
        }
        return [sel.round.payload[i] for sel, k in zip(out.selections, rounded) for i in k.tolist()]

    def _observe_skip(self, samples: list[Experience], scored: ScoredBatch) -> bool:
        """Tell the skipper this step's rolled-out groups; whether skipping is on."""
        if self.skip_stage is None:
            return False
        lengths = scored.completion_lengths
        self.skip_stage.observe_prompts(_row_prompts(samples), scored.rewards, scored.group_index, lengths)
        mean_len = float(lengths.double().mean()) if lengths is not None else 0.0
        self.last_skip_info = self.skip_stage.metrics(fallback_length=mean_len)
        return True

    def _round(
        self, scored: list[ScoredBatch], kept: list[torch.Tensor], weighted: bool = False
    ) -> list[torch.Tensor]:
        """Round the kept rows of all rounds to :attr:`batch_multiple` (``--grpo_parts.kept_rounding``),
        unless the filter kept every row it saw (then the batch is what plain OpenRLHF trains on).
        A weighted draw rounds up only: dropping drawn rows would bias it."""
        total = sum(int(k.numel()) for k in kept)
        self.rounded_rows = 0
        if total == sum(s.size for s in scored):
            return kept
        mode: Literal["up", "down"] = "up" if self.kept_rounding == "up" or weighted else "down"
        rounded = round_kept_rows(scored, kept, self.batch_multiple, mode, field="train.batch_size")
        self.rounded_rows = sum(int(k.numel()) for k in rounded) - total
        if weighted and self.rounded_rows < 0:
            raise GRPOPartsError(
                f"train.batch_size: a weighted draw of {total} rows cannot be rounded up to a multiple of "
                f"{self.batch_multiple} from {sum(s.size for s in scored)} rolled-out rows"
            )
        return rounded

    def _generate_more(self, num_prompts: int) -> list[Experience]:
        """``num_prompts`` more prompts' samples from the trainer's samples generator (same
        dataloader stream, so refill prompts are not seen twice in the episode)."""
        return list(
            self.samples_generator.generate_prompts(
                num_prompts, before_wake=self.free_gpu_for_vllm, **self.generate_kwargs
            )
        )

    def free_gpu_for_vllm(self) -> None:
        """Before a refill wakes sleeping vLLM engines: leave the GPU as OpenRLHF's loop leaves it
        before generation (DeepSpeed states offloaded, CUDA caches emptied when colocated;
        docs/adapters/openrlhf.md, "CompletionFilter")."""
        trained = [g for g in (self.actor_model_group, self.critic_model_group) if g is not None]
        if self.args.ds.enable_sleep:
            _wait([r for g in trained for r in g.async_run_method(method_name="offload_states")])
        if self.args.train.colocate_all:
            groups = [*trained, self.initial_model_group, self.reward_model_group]
            _wait([r for g in groups if g is not None for r in g.async_run_method(method_name="empty_cache")])

    # --------------------------------------------------------------------------- OpenRLHF hooks

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples: list[Experience]) -> list[Experience]:
        samples = list(rollout_samples)
        if samples and all(s.rewards is not None for s in samples):
            kept = self._select(samples)  # before the old/ref forwards
            if not kept:
                raise NothingKept(f"completion filter {self.filter.name!r} kept 0 of {len(samples)} rows")
            return self.compute_advantages_and_returns(self.make_experience(self.split_for_ranks(kept)))
        if self.skip_stage is not None:
            why = "the rewards come from a reward model after the forwards; prompt skipping needs them with the samples"
            raise NotSupportedError("--grpo_parts.prompt_skip", [why])
        # rewards come from a reward model: forwards first, then score and filter
        experiences = self.make_experience(self.split_rollout_samples(samples))
        singles = [one for e in experiences for one in _split(e)]
        singles.sort(key=lambda e: e.index[0])  # back to rollout order (OpenRLHF's grouping)
        if self.refill_rounds > 0:
            self.counters.note(
                "filter", "no refill with a reward model (refilled rows would need the forwards again)"
            )
        kept = self._select(singles, refill=False) if singles else []
        if not kept:
            raise NothingKept(f"completion filter {self.filter.name!r} kept 0 of {len(singles)} rows")
        return self.compute_advantages_and_returns(self.split_for_ranks(kept, keep_index=True))

    def split_for_ranks(self, rows: list[Experience], keep_index: bool = False) -> list[Experience]:
        """Micro-batches of ``--rollout.micro_batch_size`` rows, one equal contiguous share of the kept
        rows per rank, in the order ``async_run_method_batch`` hands them out (docs/adapters/openrlhf.md,
        "CompletionFilter", several ranks)."""
        if self.args.train.dynamic_batch_enable or len(rows) % self.dp_size:
            return self.split_rollout_samples(rows) if not keep_index else self._micro(rows)
        if not keep_index:
            for i, r in enumerate(rows):
                r.index = [i]
        shares = rank_shares(len(rows), self.dp_size, field="train.batch_size")
        return [e for share in shares for e in self._micro([rows[i] for i in share])]

    def _micro(self, rows: list[Experience]) -> list[Experience]:
        m = self.args.rollout.micro_batch_size
        pad = self.tokenizer.pad_token_id
        return [Experience.concat_experiences(rows[i : i + m], pad) for i in range(0, len(rows), m)]

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: list[Experience]) -> list[Experience]:
        """Per-token advantages from the per-sample advantages (computed here when absent)."""
        if not experiences:
            return experiences
        if any(_ADV_KEY not in e.info for e in experiences):
            singles = [one for e in experiences for one in _split(e, keep_index=True)]
            singles.sort(key=lambda e: e.index[0])
            self.score(singles)
            by_index = {s.index[0]: s for s in singles}
            for e in experiences:
                e.rewards = torch.cat([by_index[i].rewards for i in e.index])
                for key in (_ADV_KEY, "group_reward_std"):
                    e.info[key] = torch.cat([by_index[i].info[key] for i in e.index])
        for e in experiences:
            weight = e.info.pop(_W_KEY, None)  # a weighted filter: x w x kept / rolled-out rows
            adv = e.info.pop(_ADV_KEY).to(e.rewards.dtype)
            reward = compute_reward(
                adv,
                self.kl_ctl.value,
                e.kl,
                action_mask=e.action_mask,
                reward_clip_range=self.args.reward.clip_range,
            )
            e.returns = self.get_cumulative_returns(reward, e.action_mask, 1.0)
            e.advantages = e.returns.clone()
            if weight is not None:  # the whole per-token advantage (KL in the reward too) scales
                e.advantages = e.advantages * weight.to(e.advantages)[:, None]
            e.info["return"] = reward.sum(dim=-1)
            e.kl = None
        return experiences


def _weigh(samples: list[Experience], drawn: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor) -> int:
    """Put each kept sample's weight times ``kept / rolled-out rows`` in its info (``_W_KEY``; rows the
    rounding re-added: 0); returns how many rows carry a weight."""
    w = weighted_rows(len(samples), drawn, weights, kept.numel())
    for i in kept.tolist():
        samples[i].info[_W_KEY] = w[i : i + 1].clone()
    return int((w[kept.cpu()] > 0).sum())


def _row_prompts(samples: list[Experience]) -> list[Any]:
    """Each row's prompt, as OpenRLHF keeps it in ``Experience.prompts``."""
    return [p for s in samples for p in (s.prompts or [])]


def _weigh_prompts(samples: list[Experience], kept: torch.Tensor, weights: torch.Tensor) -> None:
    """Multiply each kept sample's weight (``_W_KEY``; 1 when the filter gave none) by its prompt's
    skip weight ``weights[i]``."""
    for i in kept.tolist():
        w = samples[i].info.get(_W_KEY)
        skip_w = weights[i : i + 1].clone()
        samples[i].info[_W_KEY] = skip_w if w is None else w * skip_w


def _wait(refs: list[Any]) -> None:
    if refs:
        ray.get(refs)


def _split(e: Experience, keep_index: bool = False) -> list[Experience]:
    """One Experience per row (OpenRLHF's ``split_experience_batch``), keeping each row's ``index``."""
    index = list(e.index) if e.index is not None else None
    ones = split_experience_batch(e)
    e.index = index
    for i, one in enumerate(ones):
        one.index = [index[i]] if index is not None else None
        for f in fields(Experience):
            v = getattr(one, f.name)
            if isinstance(v, torch.Tensor) and v.dim() == 0 and Experience.is_episode_tensor_field(f.name):
                setattr(one, f.name, v.reshape(1))
            elif isinstance(v, torch.Tensor) and Experience.is_step_tensor_field(f.name):
                setattr(one, f.name, v.unsqueeze(0))
        one.info = {
            k: (v.reshape(1) if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
            for k, v in one.info.items()
        }
    return ones
