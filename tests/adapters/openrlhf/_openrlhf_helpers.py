"""Builders for OpenRLHF-shaped test data (imported by the tests after the stand-ins are installed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from grpo_parts.tiny import tiny_causal_lm


def tiny_model(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = tiny_causal_lm(
        family, vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, dtype=dtype, seed=seed
    )
    # As OpenRLHF's Actor does when it loads a model: without a cache, transformers separates packed
    # sequences by their position ids (OpenRLHF's packing_samples path on CPU relies on it).
    model.config.use_cache = False
    return float64_norms(model) if dtype == torch.float64 else model


def _rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' RMSNorm computes in float32 (``x.to(torch.float32)``), which *downcasts* a
    float64 model, so a shared prefix (gradient summed over G suffixes before the norm's backward)
    and repeated prefixes (summed after) differ at ~1e-7. Give this model's norm instances the same
    formula without the cast, so both paths are float64 end to end (as tests/attention does)."""
    import types

    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            if not hasattr(mod, "variance_epsilon"):
                raise AssertionError(f"unknown RMSNorm class {type(mod).__name__}")
            mod.forward = types.MethodType(_rms_norm, mod)
    return model


def openrlhf_batch(
    gen: torch.Generator,
    group_size: int,
    num_prompts: int,
    *,
    vocab: int = 48,
    pad: int = 0,
    env_tokens: bool = False,
    shuffle: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sequences [B, T]`` right-padded, ``attention_mask [B, T]``, ``action_mask [B, T-1]`` as
    OpenRLHF's samples generator builds them (prompt tokens 0, action tokens 1 in the action
    mask; with ``env_tokens`` some tokens inside a response are environment feedback, mask 0)."""
    rows, acts = [], []
    for _ in range(num_prompts):
        p = int(torch.randint(1, 7, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (p,), generator=gen).tolist()
        for _ in range(group_size):
            c = int(torch.randint(1, 8, (1,), generator=gen))
            resp = torch.randint(3, vocab, (c,), generator=gen).tolist()
            act = [0] * p + [1] * c
            if env_tokens and c >= 4:
                act[p + 1] = act[p + 2] = 0  # two environment-feedback tokens after the first action
            rows.append(prompt + resp)
            acts.append(act)
    order = torch.randperm(len(rows), generator=gen).tolist() if shuffle else list(range(len(rows)))
    t = max(len(r) for r in rows)
    seq = torch.full((len(rows), t), pad, dtype=torch.long)
    att = torch.zeros((len(rows), t), dtype=torch.long)
    am = torch.zeros((len(rows), t), dtype=torch.long)
    for i, j in enumerate(order):
        seq[i, : len(rows[j])] = torch.tensor(rows[j])
        att[i, : len(rows[j])] = 1
        am[i, : len(acts[j])] = torch.tensor(acts[j])
    return seq, att, am[:, 1:].bool()


class KeepFloat64(torch.nn.Module):
    """Test-only wrapper: OpenRLHF's ``Actor.forward`` casts logits to float32 (``.to(torch.float32)``);
    this keeps them float64 so the plain actor can be compared with grpo_parts at 1e-10. Nothing
    else of the plain forward changes."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _Float64Output(logits=self.inner(*args, **kwargs).logits)


class _Float64Output(dict):
    def __setitem__(self, key: str, value: Any) -> None:
        if key == "logits" and value.dtype == torch.float32 and self["logits"].dtype == torch.float64:
            return  # ignore the downcast; in-place ops (div_ by temperature) still apply
        super().__setitem__(key, value)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


def openrlhf_args(group_size: int, batch_size: int, **overrides: Any) -> SimpleNamespace:
    """The slice of OpenRLHF's hierarchized args that the experience maker and training step read."""

    def ns(**kw: Any) -> SimpleNamespace:
        return SimpleNamespace(**kw)

    args = ns(
        algo=ns(
            advantage=ns(
                estimator="group_norm",
                gamma=1.0,
                lambd=1.0,
                no_std_norm=False,
                is_correction_level="off",
                is_correction_mode="mask",
                is_correction_gating="ratio",
                is_correction_threshold=[0.5, 5.0],
            ),
            kl=ns(use_loss=True, init_coef=0.0, estimator="k3", unbiased_gradient=False),
            dynamic_filtering_enable=False,
        ),
        rollout=ns(
            n_samples_per_prompt=group_size,
            batch_size=batch_size,
            micro_batch_size=group_size,
            max_new_tokens=8,
        ),
        train=ns(
            dynamic_batch_enable=False,
            colocate_all=False,
            colocate_actor_ref=False,
            max_epochs=1,
            micro_batch_size=2,
            batch_size=2,  # one rank: an optimizer step per micro-batch
        ),
        reward=ns(
            clip_range=(-10.0, 10.0),
            overlong_buffer_len=None,
            overlong_penalty_factor=1.0,
            stop_properly_penalty_coef=None,
        ),
        actor=ns(
            entropy_coef=None,
            aux_loss_coef=0.0,
            eps_clip_low_high=(0.2, 0.2),
            dual_clip=None,
            loss_agg_mode="token-mean",
            policy_loss_type="ppo",
            num_nodes=1,
            num_gpus_per_node=1,
        ),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1, packing_samples=False),
        vllm=ns(enable_sleep=False),
    )
    for path, value in overrides.items():
        node = args
        *parents, leaf = path.split(".")
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    return args


def char_tokenizer() -> Any:
    """A tiny offline transformers tokenizer: one token per character of ``"0123456789+= "``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789+= "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def rollout_samples(gen, group_size, num_prompts, reward_values, env_tokens=False):
    """Single-sample Experiences as OpenRLHF's samples generator returns them (rewards attached)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    seq, att, am = openrlhf_batch(gen, group_size, num_prompts, env_tokens=env_tokens)
    out = []
    for i in range(seq.shape[0]):
        n = int(att[i].sum())
        r = torch.tensor([reward_values[i]], dtype=torch.float64)
        resp = int(am[i, : n - 1].sum())
        out.append(
            Experience(
                sequences=seq[i : i + 1, :n],
                attention_mask=att[i : i + 1, :n],
                action_mask=am[i : i + 1, : n - 1],
                prompts=[f"prompt {i // group_size}"],
                labels=[""],
                rewards=r,
                scores=r.clone(),
                response_length=torch.tensor([resp]),
                truncated=torch.tensor([False]),
                total_length=torch.tensor([float(n)]),
                info={"reward": r.clone(), "response_clip_ratio": torch.tensor([False])},
            )
        )
    return out


def make_maker(cls, args, **kwargs):
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    strategy = SimpleNamespace(args=args)
    return cls(
        None,
        None,
        None,
        None,
        FixedKLController(kwargs.pop("kl_coef", 0.0)),
        strategy,
        SimpleNamespace(pad_token_id=0),
        **kwargs,
    )


def fake_forwards(maker_cls, actor, kl_seed=None):
    """A maker whose ``make_experience`` runs the old-policy forward locally instead of via Ray
    (the rest of OpenRLHF's method is about dispatch), filling what the real one fills."""

    class Local(maker_cls):
        forwarded_rows = 0

        def make_experience(self, samples_list):
            gen = torch.Generator().manual_seed(kl_seed or 0)
            for s in samples_list:
                Local.forwarded_rows += len(s.sequences)
                with torch.no_grad():
                    s.action_log_probs = actor(s.sequences, s.action_mask, attention_mask=s.attention_mask)
                s.base_action_log_probs = None
                s.values = None
                s.kl = torch.zeros_like(s.action_log_probs)
                if kl_seed is not None:
                    s.kl = (
                        torch.rand(s.action_log_probs.shape, generator=gen, dtype=torch.float64)
                        * s.action_mask
                    )
                s.info["kl"] = s.kl.sum(-1)
            return samples_list

    return Local
