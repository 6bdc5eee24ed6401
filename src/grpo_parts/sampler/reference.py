"""Reference sampler: plain batched autoregressive sampling with a KV cache.

The baseline every speedup is measured against, so deliberately lean (docs/results.md: at least as
fast as ``generate``). Sharded policies (FSDP2, ZeRO-3) run their forwards together across ranks
(:func:`idle_steps`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, ClassVar

import torch

from ..attention.vision import placeholder_ids, row_positions
from ..compat import cache_kwarg, output_cache, repeat_cache_rows, select_cache_rows
from ..core import token_logprobs
from ..decoding import collector_paused, sample_tokens
from ..distributed import agree_max
from ..errors import GRPOPartsError
from ..wrappers import generation_model, inner_model, model_name, sharding
from .protocol import PromptBatch, Rollout, SamplingParams


def expand_prompts(prompts: PromptBatch, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repeat each prompt G times (prompt-major). Returns ``ids [N, P]``, ``mask [N, P]``, ``group_index [N]``."""
    ids = prompts.input_ids.repeat_interleave(group_size, dim=0)
    mask = prompts.attention_mask.long().repeat_interleave(group_size, dim=0)
    group = torch.arange(prompts.num_prompts, device=ids.device).repeat_interleave(group_size)
    return ids, mask, group


def check_model(model: torch.nn.Module) -> list[str]:
    """Reasons a module cannot be sampled from like a transformers causal LM (empty = fine); a
    wrapped model is checked by its inner model (:func:`~grpo_parts.wrappers.inner_model`)."""
    cfg = getattr(inner_model(model), "config", None)
    if cfg is None:
        return [f"model: expected a transformers PreTrainedModel with .config, got {model_name(model)}"]
    if getattr(cfg, "is_encoder_decoder", False):
        return [f"model: encoder-decoder models ({cfg.model_type}) are not supported, only decoder-only LMs"]
    return []


class ReferenceSampler:
    """Batched sampling from any transformers causal LM (``AutoModelForCausalLM``), bare or wrapped
    (see the module docstring)."""

    name: ClassVar[str] = "reference"
    #: rolls out image prompts (:func:`~.protocol.image_prompt_reasons`)
    takes_images: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module):
        reasons = check_model(model)
        if reasons:
            raise GRPOPartsError("; ".join(reasons))
        self.model = model

    def not_supported_reasons(self, params: SamplingParams) -> list[str]:
        return check_model(self.model)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        self.model = policy  # samples from the training module itself (nothing to copy)

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        # inference_mode skips autograd bookkeeping (docs/results.md, Sampler); its tensors cannot
        # enter autograd later (the rollout feeds the training forward), so clone them out of it.
        # Not for a wrapped or sharded policy: FSDP / ZeRO-3 write the gathered weights into the
        # parameters, which must not become inference tensors (the training forward saves them).
        model, lockstep = generation_model(self.model)
        plain = model is self.model and sharding(model) is None
        with torch.inference_mode() if plain else torch.no_grad(), collector_paused():
            ro = self._generate(model, lockstep, prompts, params, generator)
        tensors = [f.name for f in fields(ro) if isinstance(getattr(ro, f.name), torch.Tensor)]
        return replace(ro, **{name: getattr(ro, name).clone() for name in tensors})

    def _generate(
        self, model: torch.nn.Module, lockstep: bool, prompts: PromptBatch, params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Rollout:  # fmt: skip
        device = next(model.parameters()).device
        ids, mask, group = (t.to(device) for t in expand_prompts(prompts, params.group_size))
        vocab = getattr(model.config, "vocab_size", None)
        if vocab is not None and int(ids.max()) >= vocab:
            raise GRPOPartsError(
                f"PromptBatch.input_ids: expected token ids < vocab_size={vocab}, got {int(ids.max())}"
            )
        banned = None
        if prompts.vision is None:
            start = prefill(model, ids, mask)
        else:  # each prompt and its images once, its cache then shared by its group's rows
            images = prompts.vision.gather(list(range(prompts.num_prompts)))
            start = prefill(
                model, prompts.input_ids.to(device), prompts.attention_mask.long().to(device),
                {k: v.to(device) for k, v in images.items()}, params.group_size,
            )  # fmt: skip
            banned = placeholder_ids(model).to(device)  # a completion holding one could not be scored
        completion, lp = _sample(model, ids, mask, params, generator, start, lockstep, banned)
        cmask = completion_mask_from_eos(completion, params.eos_token_ids)
        ro = padded_rollout(ids, mask, group, completion, cmask, lp, params, prompts.num_prompts)
        return ro if prompts.vision is None else replace(ro, vision=prompts.vision)


#: what decoding starts from: ``(KV cache, logits [N, V] predicting the first token, the next
#: position ids [N, 1])``
Start = tuple[Any, torch.Tensor, torch.Tensor]


def prefill(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
    images: dict[str, torch.Tensor] | None = None, repeats: int = 1,
) -> Start:  # fmt: skip
    """The (left-padded) prompts ``ids`` with their ``images`` through the model once, at the
    positions generation gives them (:func:`~grpo_parts.attention.vision.row_positions`: counting real
    tokens, so every row's first token has position 0; M-RoPE's from the model), then each row's
    cache, logits and next text position repeated ``repeats`` times (prompt-major, as
    :func:`expand_prompts`): a group's rows share its prompt's one prefill."""
    images = images or {}
    pos, deltas = row_positions(model, ids, mask, images)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **images
    )
    cache, logits = output_cache(out), out.logits[:, -1]
    next_pos = mask.sum(-1, keepdim=True) + deltas.to(mask.device)  # the text position after the prompt
    if repeats > 1:
        repeat_cache_rows(cache, repeats)
        logits, next_pos = logits.repeat_interleave(repeats, 0), next_pos.repeat_interleave(repeats, 0)
    return cache, logits, next_pos


def _sample(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None, start: Start, lockstep: bool = False,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """From the prefilled prompts (``start``), one forward per token for the rows still generating:
    ``(completion [N, T], logprobs [N, T])``, ``T`` the steps taken (<= ``max_new_tokens``), the
    tokens after a row's EOS left as ``pad_token_id`` / 0. ``lockstep``: the ranks agree before each
    decode forward whether any of them still decodes (:func:`idle_steps`). ``banned``: token ids
    never sampled (their probability goes to the others); the log-probs stay the model's own."""
    device = ids.device
    n = ids.shape[0]
    eos = torch.tensor(params.eos_token_ids or (-1,), device=device)
    cache, logits, next_pos = start
    cache_kw = cache_kwarg(model)

    # Finished rows leave the batch (and the KV cache) at once, as vLLM's scheduler does; they
    # cost nothing more. (``generate`` keeps them until the last row finishes.)
    tmax = params.max_new_tokens
    completion = torch.full((n, tmax), params.pad_token_id, dtype=ids.dtype, device=device)
    lp = torch.zeros(n, tmax, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    lp = lp.to(device)
    act = torch.arange(n, device=device)  # rollout rows still generating, in cache order
    steps = 0
    for step in range(tmax):
        tok = sample_tokens(
            logits if banned is None else logits.index_fill(-1, banned, -torch.inf), params, generator
        )
        completion[act, step] = tok
        lp[act, step] = token_logprobs(logits, tok, params.logprob_temperature).to(lp.dtype)
        steps = step + 1
        if step == tmax - 1:
            break
        fin = torch.isin(tok, eos)
        if bool(fin.any()):
            keep = (~fin).nonzero().squeeze(1)
            if keep.numel() == 0:
                if lockstep:  # with a sampled token: never an image placeholder (a prompt's may be)
                    idle_steps(model, tok[:1, None], tmax - 1 - step)
                break
            act, tok, mask, next_pos = act[keep], tok[keep], mask[keep], next_pos[keep]
            select_cache_rows(cache, keep)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if lockstep:
            agree_max([1], device=device)  # this rank decodes on: see idle_steps
        out = model(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
            **{cache_kw: cache},
        )  # fmt: skip
        cache, logits = output_cache(out), out.logits[:, -1]
        next_pos = next_pos + 1
    return completion[:, :steps], lp[:, :steps]


def idle_steps(model: torch.nn.Module, token: torch.Tensor, steps: int) -> None:
    """A rank whose rows have all finished, while its weights are sharded across ranks: before each
    of the (at most ``steps``) decode forwards left, agree with the others (an all-reduce of "still
    decoding", which each decoding rank joins with 1 before its forward) and, while any rank still
    decodes, run a one-token forward (``token: [1, 1]``) so that its all-gathers meet theirs."""
    for _ in range(steps):
        if agree_max([0], device=token.device)[0] == 0:
            return
        model(input_ids=token, use_cache=False)


def completion_mask_from_eos(completion: torch.Tensor, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``[N, T]`` mask: 1 up to and including the first EOS of each row, 0 after."""
    if not eos_token_ids:
        return torch.ones_like(completion)
    is_eos = torch.isin(completion, torch.tensor(eos_token_ids, device=completion.device)).long()
    after = is_eos.cumsum(-1) - is_eos  # number of EOS strictly before each position
    return (after == 0).long()


def padded_rollout(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor, completion: torch.Tensor,
    cmask: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams, num_prompts: int,
) -> Rollout:  # fmt: skip
    """A sampler's :class:`Rollout`, padding made plain: completion ids ``params.pad_token_id`` and
    log-probs 0 where ``cmask`` is 0 (after EOS, or past the tokens a row emitted)."""
    pad = cmask == 0
    return Rollout(
        prompt_ids, prompt_mask, completion.masked_fill(pad, params.pad_token_id), cmask,
        logprobs.masked_fill(pad, 0.0), group_index, num_prompts,
    )  # fmt: skip
