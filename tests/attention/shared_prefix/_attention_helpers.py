"""Test helpers: float64-exact tiny models and random shared-prefix batches."""

from __future__ import annotations

import types

import torch

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.compat import register_attention_function
from grpo_parts.core import grpo_loss
from grpo_parts.tiny import tiny_causal_lm


def _llama_norm(self, x):  # type: ignore[no-untyped-def]
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gemma_norm(self, x):  # type: ignore[no-untyped-def]
    return self._norm(x) * (1.0 + self.weight)


def _scaled_norm(self, x):  # type: ignore[no-untyped-def]
    out = self._norm(x)
    return out * self.weight if self.with_scale else out


def _altup_router(self, x):  # type: ignore[no-untyped-def]
    return torch.tanh(self.modality_router(self.router_norm(x) * self.router_input_scale))


def _cohere_norm(self, x):  # type: ignore[no-untyped-def]
    x = x - x.mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' RMSNorms compute in float32 (``x.to(torch.float32)``), which for a float64
    model *downcasts*: the shared prefix then sums its gradient over G suffixes in float64 before
    the norm's float32 backward while the reference sums after it, and the two differ at ~1e-7.
    Replace the forward of each RMSNorm *instance* of this model by the same formula without the
    cast, so both paths are float64 end to end (the model object is local to the test). Gemma 3n's
    AltUp router takes its ``tanh`` in float32 likewise: computed in float64 here."""
    for mod in model.modules():
        if hasattr(mod, "compute_router_modalities"):  # Gemma 3n's AltUp router: tanh in float32
            mod.compute_router_modalities = types.MethodType(_altup_router, mod)
        if type(mod).__name__ == "CohereLayerNorm":  # a LayerNorm computed in float32, the same way
            mod.forward = types.MethodType(_cohere_norm, mod)
        elif type(mod).__name__.endswith("RMSNorm"):
            # Gemma 3n / Gemma 4 first: weight (no 1 +), absent when ``with_scale=False``; from
            # transformers 5.25 these classes also carry ``variance_epsilon``
            if hasattr(mod, "with_scale"):
                mod.forward = types.MethodType(_scaled_norm, mod)
            elif hasattr(mod, "variance_epsilon"):
                mod.forward = types.MethodType(_llama_norm, mod)
            elif hasattr(mod, "_norm"):
                mod.forward = types.MethodType(_gemma_norm, mod)
            else:  # pragma: no cover - a new norm class: fail loudly rather than compare at 1e-7
                raise AssertionError(f"unknown RMSNorm class {type(mod).__name__}")
    return model


#: extra config per family so that the float64 reference (SDPA) is exact: gemma2's attention
#: soft-capping is ignored by transformers' SDPA path (up to 5.20; 5.21 dropped SDPA for gemma2),
#: so it is switched off here and tested separately against eager attention.
FAMILY_OVERRIDES = {
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": 30.0},
    "gemma3": {"final_logit_softcapping": None},
}
#: families whose transformers eager attention is float64-exact already (softmax in the input
#: dtype): their reference runs transformers' own code
OWN_EAGER_EXACT = {"gpt_oss"}


def _longrope(head_dim: int) -> dict:  # type: ignore[type-arg]
    half = head_dim // 2
    return {  # (4.x's Phi3Config accepts exactly these three keys)
        "type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }


#: position-sensitive variants of tiny families: (family, config overrides given the head dim, the
#: longest sequence a batch may hold). longrope (Phi-3.5 / Phi-4-mini) switches to its long factors
#: once the forward's largest position id reaches original_max_position_embeddings=6; dynamic NTK
#: (llama) rescales when it passes max_position_embeddings (4.x) / the original context (5.x); learned
#: absolute positions (GPT-2) index a table of exactly the context.
VARIANTS = {
    "phi3_longrope": (
        "phi3",
        lambda d: {
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 6,
            "rope_scaling": _longrope(d),
        },
        64,
    ),
    "phimoe_longrope": (
        "phimoe",
        lambda d: {
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 6,
            "rope_scaling": {**_longrope(d), "short_mscale": 1.1, "long_mscale": 1.2},
        },
        64,
    ),
    "llama_dynamic": (
        "llama",
        lambda d: {"max_position_embeddings": 8, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
        8,
    ),
    "gpt2_context": ("gpt2", lambda d: {"max_position_embeddings": 8}, 8),
    "gpt_bigcode_context": ("gpt_bigcode", lambda d: {"max_position_embeddings": 8}, 8),
    # heterogeneous layers (their own layer counts: do not pass num_layers): Gemma 3n's per-layer MLP
    # widths, activation sparsity on layer 0, AltUp / LAuReL / per-layer inputs, KV sharing ...
    "gemma3n_layers": (
        "gemma3n",
        lambda d: {
            "num_layers": 4,
            "intermediate_size": [64, 48, 80, 32],
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "num_kv_shared_layers": 2,
        },
        64,
    ),
    # ... Gemma 4's full-attention layers with their own head size (per_layer_config from
    # transformers 5.16), KV sharing and a double-wide MLP on the sharing layers ...
    "gemma4_layers": (
        "gemma4",
        lambda d: {
            "num_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
        },
        64,
    ),
    # ... keys that are the values on full-attention layers, which have their own KV heads too ...
    "gemma4_k_eq_v": (
        "gemma4",
        lambda d: {
            "num_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
        },
        64,
    ),
    # ... and a mixture-of-experts block beside every MLP (Gemma 4's MoE variants)
    "gemma4_moe": (
        "gemma4",
        lambda d: {
            "num_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 16,
        },
        64,
    ),
    # MiniCPM3's attention: DeepSeek-V2's MLA with a low-rank query, dense MLPs, v head = nope head
    "minicpm3_like": (
        "deepseek_v2",
        lambda d: {"q_lora_rank": 8, "first_k_dense_replace": 8, "v_head_dim": 8, "qk_rope_head_dim": d},
        64,
    ),
}


def variant_family(name: str) -> str:
    return VARIANTS[name][0] if name in VARIANTS else name


def exact_model(family: str, **kw) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    if family in VARIANTS:
        base, overrides, _ = VARIANTS[family]
        d = kw.get("head_dim") or kw.get("hidden_size", 32) // kw.get("num_heads", 4)
        return exact_model(base, **{**overrides(d), **kw})
    over = {**FAMILY_OVERRIDES.get(family, {}), **kw}
    model = tiny_causal_lm(family, dtype=torch.float64, **over)
    with torch.no_grad():  # larger weights than the default init, so attention is far from uniform
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(4.0)
            elif name.endswith("sinks"):  # attention sinks: comparable to the attention logits
                p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    if model.config._attn_implementation != "sdpa" and family not in OWN_EAGER_EXACT:
        # no SDPA for this family in this transformers (gemma2 from 5.21): the reference runs the
        # float64-exact eager attention below, never transformers' eager (float32 softmax)
        assert model.config._attn_implementation == "eager"
        use_exact_eager(model)
    return exact_norms(model)


def random_batch(
    gen: torch.Generator,
    group_sizes: list[int],
    *,
    vocab: int,
    max_prompt: int,
    max_completion: int,
    shuffle: bool = True,
    max_total: int | None = None,
) -> LogprobBatch:
    """Groups with random prompt lengths (left-padded) and completion lengths (right-padded), each
    row at most ``max_total`` tokens long."""
    rows_p, rows_pm, rows_c, rows_cm, gidx = [], [], [], [], []
    for g, size in enumerate(group_sizes):
        plen = int(torch.randint(1, max_prompt + 1, (1,), generator=gen))
        prompt = torch.randint(1, vocab, (max_prompt,), generator=gen)
        pmask = (torch.arange(max_prompt) >= max_prompt - plen).long()
        for _ in range(size):
            longest = max_completion if max_total is None else max(1, min(max_completion, max_total - plen))
            clen = int(torch.randint(1, longest + 1, (1,), generator=gen))
            rows_p.append(prompt.clone())
            rows_pm.append(pmask)
            rows_c.append(torch.randint(1, vocab, (max_completion,), generator=gen))
            rows_cm.append((torch.arange(max_completion) < clen).long())
            gidx.append(3 * g + 1)  # non-contiguous group ids
    order = torch.randperm(len(gidx), generator=gen) if shuffle else torch.arange(len(gidx))
    return LogprobBatch(
        torch.stack(rows_p)[order],
        torch.stack(rows_pm)[order],
        torch.stack(rows_c)[order],
        torch.stack(rows_cm)[order],
        torch.tensor(gidx)[order],
    )


EXACT_EAGER = "grpo_test_exact_eager"


def _exact_eager_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, s_aux=None, **kw
):  # type: ignore[no-untyped-def]
    """float64-exact eager attention with soft-capping and attention sinks (``s_aux``: one logit per
    head in the softmax, no value), as transformers' eager (whose softmax may run in float32)."""
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = (query @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        s = s + attention_mask[..., : k.shape[-2]]
    if s_aux is not None:
        sink = s_aux.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        return (torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ v).transpose(1, 2).contiguous(), None
    return (torch.softmax(s, -1) @ v).transpose(1, 2).contiguous(), None


def use_exact_eager(model: torch.nn.Module) -> torch.nn.Module:
    register_attention_function(EXACT_EAGER, _exact_eager_attention, mask="eager")
    model.set_attn_implementation(EXACT_EAGER)
    return model


def pack(batch: LogprobBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl remove-padding layout: ``(input_ids [total], cu_seqlens [N+1], prompt_lens [N])``."""
    seqs, plens = [], []
    for n in range(batch.prompt_ids.shape[0]):
        p = batch.prompt_ids[n][batch.prompt_mask[n].bool()]
        c = batch.completion_ids[n][batch.completion_mask[n].bool()]
        seqs.append(torch.cat([p, c]))
        plens.append(p.numel())
    lens = torch.tensor([s.numel() for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return torch.cat(seqs), cu, torch.tensor(plens)


def logps_and_grads(backend, model, batch, temperature=1.0):  # type: ignore[no-untyped-def]
    out = backend.completion_logprobs(model, batch, temperature=temperature, compute_entropy=True)
    n = batch.prompt_ids.shape[0]
    adv = torch.linspace(-1.0, 1.5, n, dtype=torch.float64)
    old = out.logprobs.detach() + 0.03 * torch.cos(
        torch.arange(out.logprobs.numel(), dtype=torch.float64)
    ).view_as(out.logprobs)
    loss = grpo_loss(out.logprobs, old, adv, batch.completion_mask).loss
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
