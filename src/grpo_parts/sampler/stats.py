"""The keys of ``Rollout.stats`` that more than one module writes or reads, also the metric names
users see (``metrics.jsonl``, TRL's ``parts/sampler/<key>``): never rename one. The plain samplers
report none of them."""

from __future__ import annotations

# ---------------------------------------------------------------- speculative decoding, per rollout
#: tokens emitted per row verification (1.0 when nothing was verified)
ACCEPTED_PER_VERIFY = "accepted_per_verify"
#: accepted draft tokens / drafted tokens
DRAFT_ACCEPT_RATE = "draft_accept_rate"
#: drafted tokens per row verification
MEAN_DRAFT_TOKENS = "mean_draft_tokens"
#: decode steps that verified a draft / ran plain / verified a tree / of those, a sampled tree
VERIFY_STEPS = "verify_steps"
PLAIN_STEPS = "plain_steps"
TREE_STEPS = "tree_steps"
SAMPLED_TREE_STEPS = "sampled_tree_steps"
#: the sampler's running estimate of the per-token acceptance rate
ACCEPTANCE_ESTIMATE = "acceptance_estimate"
#: KV-cache layers grown in place (room reserved) instead of re-allocated
KV_IN_PLACE_LAYERS = "kv_in_place_layers"
#: seconds of the draft's own update after the rollout (``train_draft``)
DRAFT_UPDATE_S = "draft_update_s"
#: draft updates so far (the speculative sampler's own online training, ``train_draft``)
DRAFT_UPDATES = "draft_updates"

# ------------------------------------------------------- decode-loop calls per path, per rollout
#: attention calls (layers x forwards) that read each group's prompt once
DECODE_ATTENTION_SHARED_PREFIX_CALLS = "decode_attention_shared_prefix_calls"
#: attention calls through the policy's own attention
DECODE_ATTENTION_PLAIN_CALLS = "decode_attention_plain_calls"
#: of the plain calls, those served without copying K/V per query head (GQA models)
DECODE_ATTENTION_PLAIN_GQA_CALLS = "decode_attention_plain_gqa_calls"
#: decode attention path (``DecodeLayout.calls`` key) -> its stats key
DECODE_ATTENTION_CALLS = {
    "shared_prefix": DECODE_ATTENTION_SHARED_PREFIX_CALLS,
    "plain": DECODE_ATTENTION_PLAIN_CALLS,
    "plain_gqa": DECODE_ATTENTION_PLAIN_GQA_CALLS,
}
#: decode forwards that called the policy's weights directly / ran the model's own forward
LEAN_FORWARD_CALLS = "lean_forward_calls"
MODEL_FORWARD_CALLS = "model_forward_calls"
#: rollouts whose decode loop could not run the lean forward / the shared-prompt decode attention
#: for a reason other than the config turning it off (the sampler logs the reasons; 0 or 1 each)
LEAN_FORWARD_REFUSED = "lean_forward_refused"
DECODE_ATTENTION_REFUSED = "decode_attention_refused"

#: the call counts a training step sums over its rollouts (None in the metrics when none reported)
STEP_CALL_COUNTS = (
    VERIFY_STEPS,
    TREE_STEPS,
    DECODE_ATTENTION_SHARED_PREFIX_CALLS,
    DECODE_ATTENTION_PLAIN_CALLS,
    LEAN_FORWARD_CALLS,
    MODEL_FORWARD_CALLS,
    LEAN_FORWARD_REFUSED,
    DECODE_ATTENTION_REFUSED,
)


def speculative_stats(counts: dict[str, float], acceptance_estimate: float) -> dict[str, float]:
    """A speculative rollout's ``Rollout.stats`` from its decode loop's counters. ``counts``: the
    step counts, :data:`KV_IN_PLACE_LAYERS`, the decode-loop call counts, and the loop's own
    ``drafted`` (draft tokens verified), ``accepted`` (of those, accepted), ``emitted_spec`` (tokens
    emitted by verifications) and ``row_verifies`` (rows x verifications)."""
    rv = max(counts["row_verifies"], 1.0)
    steps = (VERIFY_STEPS, PLAIN_STEPS, TREE_STEPS, SAMPLED_TREE_STEPS)
    calls = (KV_IN_PLACE_LAYERS, *DECODE_ATTENTION_CALLS.values(), LEAN_FORWARD_CALLS, MODEL_FORWARD_CALLS)
    return {
        ACCEPTED_PER_VERIFY: counts["emitted_spec"] / rv if counts["row_verifies"] else 1.0,
        DRAFT_ACCEPT_RATE: counts["accepted"] / max(counts["drafted"], 1.0),
        MEAN_DRAFT_TOKENS: counts["drafted"] / rv,
        **{key: counts[key] for key in steps},
        ACCEPTANCE_ESTIMATE: acceptance_estimate,
        **{key: counts[key] for key in calls},
        # a path the loop could not take (the sampler logged why): never silently off
        LEAN_FORWARD_REFUSED: counts.get(LEAN_FORWARD_REFUSED, 0.0),
        DECODE_ATTENTION_REFUSED: counts.get(DECODE_ATTENTION_REFUSED, 0.0),
    }
