"""FastGRPO's two additions on vLLM's speculative path: the draft length per batch size from the
cost model (:meth:`CostModel.k_schedule`, swapped in between rollouts on an in-process engine) and a
draft LM distilled towards the policy on every rollout. docs/vllm.md, "Speculative decoding".
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ...decoding import SamplingParams
from ...errors import GRPOPartsError
from ..protocol import Rollout
from .config import KRange, OnlineDraftConfig, VLLMSpeculative

logger = logging.getLogger(__name__)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling distribution at ``temperature`` (one-hot argmax when greedy)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def completion_logits(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor
) -> torch.Tensor:
    """``model``'s logits predicting each token of ``completion: [n, T]`` after its prompt, ``[n, T, V]``."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids, completion], dim=1).to(device)
    mask = torch.cat([prompt_mask.long(), torch.ones_like(completion)], dim=1).to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, prompt_ids.shape[1] - 1 : -1]


class OnlineLMDraft:
    """``OnlineLMDraft(draft_dir, config, device)``: the torch copy of vLLM's draft LM, trained online.
    :meth:`update` returns ``{"draft_loss", "draft_acceptance"}``: the acceptance is measured on the
    rollout *before* the update (the draft that generated it), over real completion tokens."""

    def __init__(self, path: str, config: OnlineDraftConfig, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.config = config
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model = model.to(device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.updates = 0

    def update(self, policy: torch.nn.Module, rollout: Rollout, params: SamplingParams) -> dict[str, float]:
        cmask = rollout.completion_mask.bool()
        rows = torch.nonzero(cmask.any(-1)).flatten()
        if rows.numel() == 0:
            return {"draft_loss": 0.0, "draft_acceptance": float("nan")}
        t = params.temperature
        acc_sum, acc_n, loss_sum, steps = 0.0, 0, 0.0, 0
        for epoch in range(self.config.epochs):
            order = rows[torch.randperm(rows.numel(), generator=self.gen)]
            for part in order.split(self.config.minibatch_rows):
                m = cmask[part].to(next(self.model.parameters()).device)
                minibatch = [
                    x[part] for x in (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids)
                ]
                with torch.no_grad():
                    p = _probs(completion_logits(policy, *minibatch).float(), t)
                with torch.enable_grad():  # an in-process vLLM engine turns autograd off
                    q_logits = completion_logits(self.model, *minibatch).float()
                if epoch == 0:  # the draft that sampled this rollout
                    with torch.no_grad():
                        acc = torch.minimum(p, _probs(q_logits, t)).sum(-1)
                    acc_sum, acc_n = acc_sum + float(acc[m].sum()), acc_n + int(m.sum())
                with torch.enable_grad():
                    logq = torch.log_softmax(q_logits / (t if t > 0 else 1.0), dim=-1)
                    loss = -(p * logq).sum(-1)[m].mean()
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
                self.opt.step()
                loss_sum, steps = loss_sum + float(loss.detach()), steps + 1
        self.updates += 1
        return {"draft_loss": loss_sum / max(1, steps), "draft_acceptance": acc_sum / max(1, acc_n)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's weights in its checkpoint format (what vLLM's drafter reloads)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def cost_model_table(
    policy: torch.nn.Module, draft: torch.nn.Module | None, spec: VLLMSpeculative, max_rows: int,
    max_model_len: int, accept: float,
) -> tuple[list[KRange], Any]:  # fmt: skip
    """``(table, cost model)``: the draft length per batch size ``1 .. max_rows`` that maximises expected
    tokens per second, from the policy's and the draft's forward times on the policy's device. ``draft``: the
    draft LM (None: ``spec.model`` is loaded for method ``draft_model``; n-gram proposals cost no forward)."""
    from ...draft.ngram import NGramDraft
    from ...draft.small_lm import CachedLMDraft
    from ..speculative.calibration import calibrate, calibration_context

    if spec.method not in ("draft_model", "ngram"):
        raise GRPOPartsError(
            f"speculative.k_schedule='cost_model': expected method 'draft_model' or 'ngram' (drafts whose cost "
            f"grpo_parts can time), got {spec.method!r}; give k_per_batch_size instead"
        )
    if draft is None and spec.method == "draft_model":
        from transformers import AutoModelForCausalLM

        p = next(policy.parameters())
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(spec.model), dtype=p.dtype)
        draft = loaded.to(p.device)
    k = spec.num_speculative_tokens
    prompt_len = max(1, min(64, max_model_len // 4))
    new = max(1, min(256, max_model_len - prompt_len - k - 2))
    # a copy: the timed draft is frozen (eval, no grad), an online draft keeps training
    proposer = CachedLMDraft(copy.deepcopy(draft)) if draft is not None else NGramDraft()
    params = SamplingParams(group_size=1, max_new_tokens=new)
    context = calibration_context(max_rows, prompt_len, new, None, k)
    with torch.no_grad():
        cost = calibrate(policy, proposer, params, max_rows, k + 1, context, prompt_len, 2, ("off", False), k)  # type: ignore[arg-type]
    return cost.k_schedule(accept, k, max_rows), cost


def apply_table(llm: Any, table: list[KRange], max_k: int) -> bool:
    """Replace the running in-process engine's batch-size -> draft length lookup (True), or leave it
    (False: the engine core runs in another process, its start-up table stays)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or getattr(scheduler, "dynamic_sd_lookup", None) is None:
        return False
    scheduler.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
        table, vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs, vllm_num_speculative_tokens=max_k
    )
    return True
