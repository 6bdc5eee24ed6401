"""Settings of :class:`~.sampler.VLLMSampler`: the engine, vLLM's speculative decoding, and the two
things FastGRPO adds to it (:mod:`.online_draft`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: one ``(first batch size, last batch size, draft tokens)`` range of vLLM's dynamic schedule
KRange = tuple[int, int, int]


def check_k_table(table: list[KRange], max_k: int) -> list[str]:
    """Why ``table`` is not a schedule vLLM applies as written (empty: it is): inclusive,
    non-overlapping, sorted ranges from batch size 1, each ``k`` in ``0 .. max_k``."""
    reasons, nxt = [], 1
    for lo, hi, k in table:
        if lo != nxt or hi < lo:
            reasons.append(
                f"range ({lo}, {hi}, {k}): expected to start at batch size {nxt} and end >= its start"
            )
        if not 0 <= k <= max_k:
            reasons.append(f"range ({lo}, {hi}, {k}): expected 0 <= k <= num_speculative_tokens={max_k}")
        nxt = hi + 1
    if not table:
        reasons.append("expected at least one range, got []")
    return reasons


class VLLMSpeculative(BaseModel):
    """vLLM's ``speculative_config``, validated. ``model`` is the draft (``draft_model``) or EAGLE head
    directory; n-gram needs none.

    The draft length per number of rows in flight (FastGRPO's concurrency-aware sizing), one of:

    * ``k_schedule="static"``: ``num_speculative_tokens`` at every batch size, or none above
      ``disable_above_batch``;
    * ``k_per_batch_size``: an explicit table ``[(first, last, k), ...]``;
    * ``k_schedule="cost_model"``: the table :meth:`CostModel.k_schedule` computes from the policy's
      and the draft's forward times (timed at engine start on the torch copies, same device) and the
      acceptance rate (``accept_prior`` until an online draft measures it).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "draft_model", "eagle", "eagle3"]
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="the largest draft length")
    model: str | None = None
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(3, ge=1)
    disable_above_batch: int | None = Field(None, ge=1)
    k_schedule: Literal["static", "cost_model"] = "static"
    k_per_batch_size: list[KRange] | None = None
    accept_prior: float = Field(
        0.6, gt=0.0, lt=1.0, description="per-token acceptance before one is measured"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="passed through to vLLM")

    @model_validator(mode="after")
    def _check(self) -> VLLMSpeculative:
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"model: n-gram speculation takes no draft model, got {self.model!r}")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"model: method {self.method!r} needs a draft/EAGLE model directory, got None")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: expected <= prompt_lookup_max={self.prompt_lookup_max}, got {self.prompt_lookup_min}"
            )
        lossy = self.extra.get("rejection_sample_method", "standard")
        if lossy != "standard":
            raise ValueError(
                f"extra.rejection_sample_method: expected 'standard' (lossless rejection sampling), got "
                f"{lossy!r}, which changes the sampled distribution"
            )
        chosen = [self.disable_above_batch is not None, self.k_per_batch_size is not None]
        chosen.append(self.k_schedule == "cost_model")
        if sum(chosen) > 1:
            raise ValueError(
                "k_schedule: expected one of disable_above_batch, k_per_batch_size or "
                f"k_schedule='cost_model', got disable_above_batch={self.disable_above_batch}, "
                f"k_per_batch_size={self.k_per_batch_size}, k_schedule={self.k_schedule!r}"
            )
        if self.k_per_batch_size is not None:
            bad = check_k_table(self.k_per_batch_size, self.num_speculative_tokens)
            if bad:
                raise ValueError(f"k_per_batch_size: {'; '.join(bad)}")
        return self

    def table(self, max_num_seqs: int) -> list[KRange] | None:
        """The schedule this config asks vLLM for (None: the static ``num_speculative_tokens``)."""
        if self.k_per_batch_size is not None:
            return list(self.k_per_batch_size)
        off = self.disable_above_batch
        if off is not None and off < max_num_seqs:
            return [(1, off, self.num_speculative_tokens), (off + 1, max_num_seqs, 0)]
        return None

    def to_vllm(self, max_num_seqs: int) -> dict[str, Any]:
        cfg: dict[str, Any] = dict(method=self.method, num_speculative_tokens=self.num_speculative_tokens)
        if self.method == "ngram":
            cfg.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        else:
            cfg["model"] = self.model
        table = self.table(max_num_seqs)
        if table is not None:
            cfg["num_speculative_tokens_per_batch_size"] = table
        cfg.update(self.extra)
        return cfg


class OnlineDraftConfig(BaseModel):
    """FastGRPO's online draft on vLLM's ``draft_model`` path: after every rollout a torch copy of the
    draft LM is distilled towards the policy on the rollout's completions (soft cross-entropy against
    the policy's sampling distribution), then its weights are reloaded into the engine's drafter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-3, gt=0.0, description="AdamW learning rate of the draft")
    epochs: int = Field(1, ge=1, description="passes over each rollout")
    minibatch_rows: int = Field(16, ge=1, description="completions per draft optimizer step")
    max_grad_norm: float = Field(1.0, gt=0.0)
    seed: int = 0


class VLLMConfig(BaseModel):
    """Engine settings. ``engine_kwargs`` go to ``vllm.LLM`` unchanged (they win over the fields).

    ``logprobs``: ``"vllm"`` returns vLLM's own log-probs (refused where they differ from grpo_parts'
    definition); ``"recompute"`` rescores every rollout with the synced torch policy (one forward).
    ``trust_speculative``: allow a speculative method not in :data:`VERIFIED_SPECULATIVE_ON_CPU` on CPU.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str = "auto"
    max_model_len: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    enforce_eager: bool = True
    seed: int = 0
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="GPU only; colocated")
    cpu_kvcache_space_gib: int | None = Field(None, ge=1, description="sets VLLM_CPU_KVCACHE_SPACE (GiB)")
    logprobs: Literal["vllm", "recompute"] = "vllm"
    speculative: VLLMSpeculative | None = None
    trust_speculative: bool = False
    online_draft: OnlineDraftConfig | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> VLLMConfig:
        spec = self.speculative
        if self.online_draft is not None and (spec is None or spec.method != "draft_model"):
            raise ValueError(
                "online_draft: expected speculative.method='draft_model' (the draft LM it trains and reloads), "
                f"got {None if spec is None else spec.method!r}"
            )
        return self
