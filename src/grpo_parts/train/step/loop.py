"""The GRPO step, composed from the parts (docs/training.md, "The step"). Time is split into rollout
(sampler calls), training (log-probs, draft and policy updates) and other (tokenising, rewards,
filter); held-out evaluation is timed separately, outside ``wall_time``."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from ...attention.protocol import PLAN_CHUNKS, CountsAttentionCalls, LogprobBatch, ReportsPlan
from ...core import grpo_loss
from ...counters import ATTENTION_CALLS
from ...errors import NotSupportedError
from ...filter.protocol import KEPT_FRACTION, WEIGHTED_ROWS
from ...filter.refill import FilledBatch, Refiller, RefillOutcome, fill_rollouts
from ...sampler.protocol import SamplingParams, TracesDecode, TrainsDraft
from ...sampler.reference import ReferenceSampler
from ...task.data import (
    BatchRewards,
    Problem,
    ReportsRewardTerms,
    Task,
    completion_ids,
    decode_completions,
    encode_problems,
    eval_accuracy,
    text_tokenizer,
)
from ...types import PromptBatch, Rollout, Stateful
from ..config import TrainConfig
from .minibatches import Minibatch, split_minibatches, weighted_filter_reasons
from .parts import Parts
from .prompt_skip import observe_step, skip_minibatches, skipping_stream
from .step_record import StepRecord, rollout_metrics, zero_variance_share


class ProblemStream(Iterator[Problem]):
    """The task's training problems from the trainer's data position on (advances it)."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def __next__(self) -> Problem:
        p = self.trainer.task.train_problem(self.trainer.data_pos)
        self.trainer.data_pos += 1
        return p

    def peek(self) -> Problem:  # the next problem, not consumed (a prompt skipper's round reads ahead)
        return self.trainer.task.train_problem(self.trainer.data_pos)


class GRPOTrainer:
    """Holds the policy, optimizer, parts and data position; ``step()`` runs one GRPO step.
    ``tokenizer``: the policy's tokenizer, or a vision-language policy's processor."""

    def __init__(
        self,
        config: TrainConfig,
        policy: torch.nn.Module,
        tokenizer: Any,
        task: Task,
        parts: Parts,
        eos_token_ids: tuple[int, ...],
        ref_model: torch.nn.Module | None = None,
    ):
        self.config, self.policy, self.tokenizer, self.task = config, policy, tokenizer, task
        self.parts, self.ref_model = parts, ref_model
        self.device = next(policy.parameters()).device
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        pad = text_tokenizer(tokenizer).pad_token_id
        self.pad_token_id = int(pad if pad is not None else eos_token_ids[0])
        self.params = SamplingParams(
            group_size=config.group_size, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, eos_token_ids=eos_token_ids, pad_token_id=self.pad_token_id,
        )  # fmt: skip
        self.eval_params = self.params.model_copy(
            update={"temperature": config.eval_temperature, "top_p": 1.0, "top_k": 0}
        )
        self.step_idx = 0
        self.last_trace: dict[str, Any] | None = None  # the speculative sampler's per-decode-step trace
        self.last_samples: list[tuple[str, Problem, float]] = []  # the last step's completions and rewards
        self.eval_samples: list[tuple[str, Problem, float]] = []  # the last evaluation's
        self.data_pos = 0
        self.wall_time = 0.0
        self.eval_set = task.eval_problems()
        reasons = parts.sampler.not_supported_reasons(self.params)
        if reasons:
            raise NotSupportedError(f"sampler {parts.names.get('sampler')!r}", reasons)
        reasons = weighted_filter_reasons(parts.filter, config)  # dppo: an unbiased loss, no refill
        if reasons:
            raise NotSupportedError(f"filter {parts.names.get('filter')!r}", reasons)

    def prompt_batch(self, problems: list[Problem]) -> PromptBatch:
        """The problems' prompts, tokenized and left-padded (with their images), on the policy's device."""
        pb = encode_problems(self.tokenizer, problems)
        vision = None if pb.vision is None else pb.vision.to(self.device)
        return PromptBatch(pb.input_ids.to(self.device), pb.attention_mask.to(self.device), vision)

    def step(self) -> dict[str, Any]:
        """One GRPO step (see the module docstring); returns its row of ``metrics.jsonl``."""
        t_step = time.perf_counter()
        acc = StepRecord()
        filled = self._fill(acc)
        t_train = time.perf_counter()
        train_info, time_draft = self._update_draft(acc.rollouts)
        if filled.rollout is not None:
            train_info["lr"] = self._set_lr()
            batches = split_minibatches(filled, self.config.minibatches, self.config.loss.seq_count == "all")
            if self._draw is not None:  # prompt skipping: x 1/p of each prompt, normalised by the drawn
                batches = skip_minibatches(batches, filled, self._draw, self.config.loss.seq_count == "all")
            train_info.update(self._update(filled.rollout, filled.advantages.to(self.device), batches))
            self.parts.sampler.sync_weights(self.policy)
        t_end = time.perf_counter()
        time_logprobs = train_info.pop("time_logprobs", 0.0)
        self.last_trace = self._decode_trace()
        self.step_idx += 1
        time_step = t_end - t_step
        self.wall_time += time_step
        times = {
            "time_rollout": acc.rollout_s,
            "time_training": t_end - t_train,
            "time_draft": time_draft,
            # the phases of the step: rollout, old/reference log-probs, policy update, draft update
            "time_logprobs": time_logprobs,
            "time_update": max(0.0, t_end - t_train - time_draft - time_logprobs),
            "time_other": max(0.0, time_step - acc.rollout_s - (t_end - t_train)),
            "time_step": time_step,
        }
        m = self._step_metrics(acc, filled.outcome, times)
        m.update(train_info)
        if self._draw is not None:
            observe_step(self._draw, acc.rollouts, acc.rewards)  # then the metrics: the history after it
            m.update(self._draw.metrics(self.config.group_size, m["completion_len"]))
        if isinstance(self.task, ReportsRewardTerms):
            m.update({f"reward_{name}": value for name, value in self.task.last_per_function.items()})
        self.last_samples = acc.samples  # (completion, problem, reward) of this step, for samples.jsonl
        return m

    def _fill(self, acc: StepRecord) -> FilledBatch[Problem]:
        """Roll out, reward and filter (refilling as the config allows) into ``acc``."""
        cfg = self.config
        target = cfg.prompts_per_step * cfg.group_size
        rounds = 1 + cfg.parts.refill_rounds
        refiller = Refiller(target_size=target, initial_prompts=cfg.prompts_per_step, max_rounds=rounds)
        stream, self._draw = skipping_stream(self.parts.prompt_skip, ProblemStream(self))
        return fill_rollouts(
            self.parts.filter,
            refiller,
            stream,
            partial(self._sample, acc),
            partial(self._reward, acc),
            cfg.advantage,
            pad_token_id=self.pad_token_id,
            kl_logprobs=self._old_and_ref if cfg.advantage.kl_coef > 0 else None,
        )

    def _sample(self, acc: StepRecord, problems: list[Problem]) -> Rollout:
        """One sampler call on ``problems`` (timed, counted into ``acc``)."""
        pb = self.prompt_batch(problems)
        t0 = time.perf_counter()
        ro = self.parts.sampler.generate(pb, self.params, self.generator)
        acc.rollout_s += time.perf_counter() - t0
        acc.tokens += int(ro.completion_mask.sum())
        acc.stats.append(dict(ro.stats))
        acc.rollouts.append(ro)
        return ro

    def _reward(self, acc: StepRecord, problems: list[Problem], ro: Rollout) -> torch.Tensor:
        """``[N]`` training rewards of ``ro``'s rows: the task's grader, or its batch reward
        (``--reward`` functions, TRL's signature) when it declares one."""
        texts = decode_completions(self.tokenizer, ro)
        rows = [problems[g] for g in ro.group_index.tolist()]
        correct = [self.task.reward(t, p) for t, p in zip(texts, rows)]
        values = (
            self.task.batch_rewards(texts, rows, completion_ids(ro), self.step_idx)
            if isinstance(self.task, BatchRewards)
            else correct
        )
        r = torch.tensor(values, dtype=torch.float32)
        acc.rewards.append(r)
        acc.correct.extend(correct)
        acc.samples.extend(zip(texts, rows, values))
        return r.to(self.device)

    def _update_draft(self, rollouts: list[Rollout]) -> tuple[dict[str, float], float]:
        """A learnable draft distils from each rollout of the step, when the sampler can build its
        batches: ``({"draft_<metric>": value}, seconds)``."""
        sampler, draft = self.parts.sampler, self.parts.draft
        info: dict[str, float] = {}
        if draft is None or not isinstance(sampler, TrainsDraft) or not draft.learnable:
            return info, 0.0
        t0 = time.perf_counter()
        for ro in rollouts:
            for k, v in draft.update(sampler.draft_training_batch(ro)).items():
                info[f"draft_{k}"] = float(v)
        return info, time.perf_counter() - t0

    def _decode_trace(self) -> dict[str, Any] | None:
        sampler = self.parts.sampler
        trace = sampler.last_trace if isinstance(sampler, TracesDecode) else None
        return None if trace is None else trace.as_dict()

    def _step_metrics(
        self, acc: StepRecord, outcome: RefillOutcome[Any], times: dict[str, float]
    ) -> dict[str, Any]:
        """The step's row before the training info: rewards, filter outcome, times, sampler stats."""
        rewards = torch.cat(acc.rewards)
        rows = max(1, outcome.rows_generated)
        m: dict[str, Any] = {
            "step": self.step_idx,
            "reward": float(rewards.mean()),
            "accuracy": sum(acc.correct) / max(1, len(acc.correct)),  # the grader's, whatever the reward
            KEPT_FRACTION: outcome.num_kept / rows,
            "kept": outcome.num_kept,
            "prompts": outcome.prompts_used,
            "rounds": outcome.rounds,
            "completion_len": acc.tokens / rows,
            "rollout_tokens": acc.tokens,  # completion tokens generated this step, every round
            "zero_variance_share": zero_variance_share(acc),
            **times,
            "tokens_per_s": acc.tokens / max(acc.rollout_s, 1e-9),
            "wall_time": self.wall_time,
            "data_pos": self.data_pos,
        }
        return {**m, **rollout_metrics(acc.stats)}

    def _set_lr(self) -> float:
        """This step's learning rate (from ``step_idx``, so a resumed run continues the schedule)."""
        cfg = self.config
        done = min(self.step_idx / cfg.steps, 1.0)
        scale = {"constant": 1.0, "linear": 1.0 - done, "cosine": 0.5 * (1.0 + math.cos(math.pi * done))}
        lr = cfg.lr * scale[cfg.lr_schedule]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _old_and_ref(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old-policy (per ``old_logprobs``) and reference log-probs of every row of ``ro``, no grad.
        Also called on each whole rollout before filtering when the reward carries a KL penalty."""
        attn, temp = self.parts.attention, self.params.logprob_temperature
        batch = LogprobBatch.from_rollout(ro)
        with torch.no_grad():
            old = ro.logprobs
            if self.config.old_logprobs == "recompute":
                old = attn.completion_logprobs(self.policy, batch, temp).logprobs
            ref = None
            if self.ref_model is not None:
                ref = attn.completion_logprobs(self.ref_model, batch, temp).logprobs
        return old, ref

    def _update(self, ro: Rollout, advantages: torch.Tensor, batches: list[Minibatch]) -> dict[str, float]:
        """The policy update: one optimizer step per minibatch; a weighted minibatch (``dppo``) multiplies its
        rows by their weights over the minibatch's share of the whole rolled-out batch."""
        cfg, attn = self.config, self.parts.attention
        temp = self.params.logprob_temperature
        batch = LogprobBatch.from_rollout(ro)
        calls = Counter(attn.attention_calls) if isinstance(attn, CountsAttentionCalls) else Counter()
        t0 = time.perf_counter()
        old, ref = self._old_and_ref(ro)
        t_logprobs = time.perf_counter() - t0
        plan = attn.last_plan if isinstance(attn, ReportsPlan) else None  # shared-prefix: the grids
        grid_info = {"attention_grids": float(plan[PLAN_CHUNKS])} if plan else {}
        # the sampler's own log-probs feed rollout correction (pi_train_old / pi_sampler)
        sampler_lp = ro.logprobs if cfg.loss.correction.level != "off" else None
        entropy = cfg.loss.entropy_coef > 0
        self.policy.train()
        info: dict[str, float] = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, WEIGHTED_ROWS: 0.0}
        n = len(batches)
        for mb in batches:
            rows, w = mb.rows, mb.weights
            sub = batch.select(rows)
            lp = attn.completion_logprobs(self.policy, sub, temp, compute_entropy=entropy)
            logps = lp.logprobs
            out = grpo_loss(
                logps, old[rows].to(logps.dtype), advantages[rows].to(logps.dtype), sub.completion_mask, cfg.loss,
                None if ref is None else ref[rows].to(logps.dtype), entropy=lp.entropies,
                rollout_logps=None if sampler_lp is None else sampler_lp[rows].to(logps.dtype),
                num_tokens=mb.num_tokens, num_seqs=mb.num_seqs,
                seq_weights=None if w is None else w.to(logps.dtype),
            )  # fmt: skip
            info[WEIGHTED_ROWS] += 0 if w is None else int(rows.numel())
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
            self.optimizer.step()
            info["loss"] += float(out.loss.detach()) / n
            info["clip_fraction"] += out.clip_fraction / n
            info["kl"] += out.kl / n
            if entropy:
                info["entropy"] = info.get("entropy", 0.0) + out.entropy / n
            if sampler_lp is not None:
                info["correction_mean"] = info.get("correction_mean", 0.0) + out.correction_mean / n
        self.policy.eval()
        info["time_logprobs"] = t_logprobs
        if isinstance(attn, CountsAttentionCalls):  # the padding-free kernels' calls, per path
            info.update({ATTENTION_CALLS + k: float(v) for k, v in (attn.attention_calls - calls).items()})
        return {**info, **grid_info}

    def evaluate(self) -> tuple[float, float]:
        """Held-out accuracy (greedy by default) with the plain reference sampler, and its time."""
        t0 = time.perf_counter()
        was = self.policy.training
        self.policy.eval()
        self.eval_samples = []
        accuracy = eval_accuracy(
            ReferenceSampler(self.policy), self.task, self.eval_set, self.tokenizer, self.eval_params,
            record=self.eval_samples,
        )  # fmt: skip
        self.policy.train(was)
        return accuracy, time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: weights, optimizer, draft, data, RNG."""
        state: dict[str, Any] = {
            "step": self.step_idx,
            "data_pos": self.data_pos,
            "wall_time": self.wall_time,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {
                "generator": self.generator.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(),
            },
        }
        for key, part in self.parts.with_state().items():
            if isinstance(part, Stateful):  # e.g. dppo's generator: a resume draws the same rows
                state[key] = part.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_idx, self.data_pos = int(state["step"]), int(state["data_pos"])
        self.wall_time = float(state["wall_time"])
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng = state["rng"]
        self.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(rng["python"])
        for key, part in self.parts.with_state().items():
            if key in state and part is not None:
                part.load_state_dict(state[key])
        self.parts.sampler.sync_weights(self.policy)
