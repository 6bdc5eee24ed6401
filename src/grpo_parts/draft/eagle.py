"""EAGLE-style draft head with online learning (EAGLE, arXiv 2401.15077; FastGRPO, arXiv 2509.21792):
it predicts the policy's next last-layer feature from ``fc(concat(embed(x_{t+1}), f_t))``, KV-cached per
row (:mod:`.kv_state`). docs/speculative.md, "Drafts": the head, its loss and defaults.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..compat import attn_implementation, cache_kwarg, causal_lm_class, own_attention_function
from ..decoding import SamplingParams, additive_mask, tree_allowed
from ..decoding.lean_layer import ARCHITECTURES, layer_reasons, lean_layer, rope_tables
from ..errors import GRPOPartsError
from ..wrappers import inner_model, model_name, sharding
from .drawing import draw_chain, draw_tree, new_columns
from .kv_state import DraftKVState
from .protocol import DraftContext, DraftProposal, DraftTrainingBatch, TreeBudget
from .tree import Frontier


class EagleConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(
        1e-3, gt=0.0, description="AdamW lr (FastGRPO uses 1e-4 on 7B models; tiny ones like more)"
    )
    weight_decay: float = Field(0.0, ge=0.0)
    feature_weight: float = Field(2.0, ge=0.0)
    ce_weight: float = Field(0.1, ge=0.0)
    epochs: int = Field(4, ge=1, description="passes over each rollout batch per update")
    minibatch_rows: int = Field(8, ge=1)
    unroll: int = Field(2, ge=1, le=4)
    max_grad_norm: float = Field(1.0, gt=0.0)
    seed: int = 0
    sampled_trees: bool = Field(
        True,
        description="trees of children sampled from the head, verified by recursive rejection sampling "
        "(docs/speculative.md); False: EAGLE-2 top-K trees, verified by sample-then-match. Greedy: top-K",
    )


def _body_config(policy: torch.nn.Module) -> Any:
    cfg: Any = policy.config
    d = cfg.to_dict()
    d.update(num_hidden_layers=1, vocab_size=1)
    d.pop("layer_types", None)
    return type(cfg).from_dict(d)


class EagleHead(torch.nn.Module):
    """``fc(concat(embed, feature))`` -> one decoder layer + final norm of the policy's family.

    Drafting (a KV cache, no grad) calls the decoder layer directly with a boolean 4-D mask for
    the Llama-layer families (:data:`~grpo_parts.decoding.lean_layer.ARCHITECTURES`, whose forward is
    ``rotary_emb`` -> ``layers`` -> ``norm``): on a CPU the model wrapper's mask building and
    output plumbing are a large share of a 1-layer call, which the head pays once per draft token
    (docs/results.md, Draft models; the log's "Throughput: speculative vs reference").
    Training (no cache) always goes through the model.
    """

    def __init__(self, policy: torch.nn.Module):
        import transformers

        super().__init__()
        cfg: Any = policy.config
        h = int(cfg.hidden_size)
        p = next(policy.parameters())
        self.fc = torch.nn.Linear(2 * h, h, device=p.device, dtype=p.dtype)
        attn = cfg._attn_implementation or attn_implementation(causal_lm_class(cfg))
        self.body = transformers.AutoModel.from_config(_body_config(policy), attn_implementation=attn)
        self.body.to(device=p.device, dtype=p.dtype)
        # the boolean mask below is what the sdpa kernel takes (eager wants an additive one)
        self.direct = getattr(cfg, "model_type", None) in ARCHITECTURES and attn == "sdpa"
        # ... and its layers run as plain tensor operations where they are the Llama layer
        self.qk_norm = ARCHITECTURES.get(getattr(cfg, "model_type", None) or "", False)
        self.lean = self.direct and not layer_reasons(self.body.layers, self.qk_norm)

    def forward(
        self, emb: torch.Tensor, feat: torch.Tensor, cache: Any = None, tree: torch.Tensor | None = None,
        **kw: Any,
    ) -> Any:  # fmt: skip
        """``cache``: the head's KV cache (passed to the body under :func:`~grpo_parts.compat.cache_kwarg`).
        ``tree: [A, q, past + q]`` bool: which columns each query sees (a draft tree's mask),
        instead of the causal mask over ``attention_mask``."""
        x = self.fc(torch.cat([emb, feat.to(emb.dtype)], -1))
        if cache is None:
            return self.body(inputs_embeds=x, **kw)
        if self.direct and not torch.is_grad_enabled():
            return self._direct(x, kw["attention_mask"], kw["position_ids"], cache, tree)
        if tree is not None:
            kw["attention_mask"] = additive_mask(tree, x.dtype)
        return self.body(inputs_embeds=x, **kw, **{cache_kwarg(self.body): cache})

    def _direct(
        self, x: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache: Any,
        tree: torch.Tensor | None = None,
    ) -> Any:  # fmt: skip
        """The body's forward for a cached call, without the model wrapper. ``mask: [A, past + q]``."""
        from types import SimpleNamespace

        q, kv = x.shape[1], mask.shape[1]
        past = kv - q
        col = torch.arange(kv, device=x.device)[None, :]
        row = past + torch.arange(q, device=x.device)[:, None]
        # key j is visible to query i if it is real and not in the future; a query always sees its
        # own entry, so a hole's row (masked everywhere else) stays finite -- nobody attends to it
        if tree is not None:
            allowed = tree[:, None]
        else:
            allowed = (mask.bool()[:, None, None, :] & (col <= row)[None, None]) | (col == row)[None, None]
        emb = self.body.rotary_emb(x, position_ids)
        h = x
        if self.lean:  # the layer's ops without its module calls (the log's "Lean decode forwards")
            rope = rope_tables(*emb)
            fn = own_attention_function(self.body.layers[0].self_attn, "sdpa")
            assert fn is not None  # transformers registers sdpa in every release in range
            for i, layer in enumerate(self.body.layers):
                h = lean_layer(layer, h, rope, allowed, cache, i, fn, {}, self.qk_norm)
            return SimpleNamespace(last_hidden_state=self.body.norm(h))
        for layer in self.body.layers:
            out = layer(
                h, attention_mask=allowed, position_ids=position_ids, use_cache=True, position_embeddings=emb,
                **{cache_kwarg(layer): cache},
            )  # fmt: skip
            h = out[0] if isinstance(out, tuple) else out
        return SimpleNamespace(last_hidden_state=self.body.norm(h))


class EagleDraft:
    """``EagleDraft(policy, config)``: a learnable head sharing ``policy``'s embedding and lm_head.
    A wrapped policy (DDP, ZeRO-0/1/2: whole weights on every rank) is read through its inner model
    (:func:`~grpo_parts.wrappers.inner_model`); sharded weights (FSDP1/FSDP2/ZeRO-3) are refused:
    the head reads the embedding and lm_head outside any forward, where they are shards."""

    name: ClassVar[str] = "eagle"
    learnable: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = True

    def __init__(self, policy: torch.nn.Module, config: EagleConfig | None = None):
        if getattr(inner_model(policy), "config", None) is None:
            raise GRPOPartsError(
                f"policy: expected a transformers causal LM with .config, got {model_name(policy)}"
            )
        if sharding(policy) is not None:
            raise GRPOPartsError(f"policy: {self._sharded(policy)}")
        policy = inner_model(policy)
        self.config = config or EagleConfig()
        torch.manual_seed(self.config.seed)
        self.head = EagleHead(policy)
        self.bind_policy(policy)
        self.opt = torch.optim.AdamW(
            self.head.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )
        self.updates = 0
        self._kv: DraftKVState | None = None

    def bind_policy(self, policy: torch.nn.Module) -> None:
        model: Any = inner_model(policy)
        self.embed: Any = model.get_input_embeddings()
        self.lm_head: Any = model.get_output_embeddings()

    @staticmethod
    def _sharded(policy: torch.nn.Module) -> str:
        return (
            f"weights sharded by {sharding(policy)}: the draft reads the policy's embedding and lm_head "
            "outside its forward, where they are shards"
        )

    def not_supported_reasons(self, policy: torch.nn.Module, params: SamplingParams) -> list[str]:
        if sharding(policy) is not None:
            return [f"policy: {self._sharded(policy)}"]
        h = int(getattr(inner_model(policy), "config").hidden_size)  # noqa: B009
        if h != self.head.fc.out_features:
            return [f"hidden size: head built for {self.head.fc.out_features}, policy has {h}"]
        return []

    def reset(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor) -> None:
        self._kv = DraftKVState(torch.arange(prompts.shape[0], device=prompts.device))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # the policy's lm_head, detached: the draft never trains (or accumulates grads into) the policy
        w = self.lm_head.weight.detach()  # type: ignore[union-attr]
        b = getattr(self.lm_head, "bias", None)
        return torch.nn.functional.linear(h.to(w.dtype), w, None if b is None else b.detach())

    @torch.no_grad()
    def propose(
        self, context: DraftContext, num_tokens: int, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        kv, h = self._feed_true(context)

        def step(i: int, d: torch.Tensor) -> torch.Tensor:
            nonlocal h
            kv.append(torch.ones_like(kv.mask[:, :1]))
            h = self.head(
                self.embed(d[:, None]), h, attention_mask=kv.mask,  # type: ignore[operator]
                position_ids=context.lengths[:, None] + i, cache=kv.cache, use_cache=True,
            ).last_hidden_state  # fmt: skip
            return self._logits(h[:, 0])

        prop = draw_chain(self._logits(h[:, 0]), step, num_tokens, params, generator)
        kv.spec = num_tokens - 1
        return prop

    def _feed_true(self, context: DraftContext) -> tuple[DraftKVState, torch.Tensor]:
        """Feed the policy's true features of the tokens verified since the last call; returns the
        cache state and the head's feature at the last position ``[A, 1, H]``."""
        if context.new_hidden is None or context.num_new is None:
            raise GRPOPartsError(
                "DraftContext.new_hidden: the eagle draft needs the policy's hidden states, got None"
            )
        if self.head.training:  # Module.eval() walks every submodule: not once per draft call
            self.head.eval()
        kv = self._kv = self._kv or DraftKVState(context.rows)  # propose without reset: a fresh cache
        # drop last call's drafted entries (the policy's true features replace them) and finished rows
        kv.begin_call(context.rows)
        feats, num = context.new_hidden, context.num_new
        m = feats.shape[1]
        valid, pos = new_columns(num, context.lengths, m)
        kv.append(valid)
        toks = context.tokens[:, -m:]
        if toks.shape[1] < m:  # a chain longer than the short rows' text so far: masked filler (valid = 0)
            toks = torch.nn.functional.pad(toks, (m - toks.shape[1], 0))
        out = self.head(
            self.embed(toks), feats, attention_mask=kv.mask, position_ids=pos,  # type: ignore[operator]
            cache=kv.cache, use_cache=True,
        )  # fmt: skip
        return kv, out.last_hidden_state[:, -1:]

    @torch.no_grad()
    def propose_tree(
        self, context: DraftContext, budget: TreeBudget, params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:  # fmt: skip
        """One head call per level: the level's expanded nodes fed together under a tree mask (the
        tree's kind: :func:`~.drawing.draw_tree`)."""
        kv, h_root = self._feed_true(context)
        past = kv.mask.shape[1]
        feats: list[torch.Tensor] = []  # the head's output at every fed node, in feeding order

        def expand(fr: Frontier) -> torch.Tensor:
            allf = torch.cat(feats, 1) if feats else h_root[:, :0]
            idx = fr.fed_parent.clamp(min=0)[..., None].expand(-1, -1, h_root.shape[-1])
            parent_f = torch.where(
                fr.fed_parent[..., None] >= 0, allf.gather(1, idx) if feats else h_root, h_root
            )
            kv.append(torch.ones_like(fr.tokens))
            tree = tree_allowed(kv.mask[:, :past], fr.anc)
            out = self.head(
                self.embed(fr.tokens), parent_f, attention_mask=kv.mask, cache=kv.cache, use_cache=True,  # type: ignore[operator]
                position_ids=(context.lengths[:, None] + fr.depth - 1).expand_as(fr.tokens), tree=tree,
            )  # fmt: skip
            feats.append(out.last_hidden_state)
            return self._logits(out.last_hidden_state)

        root = self._logits(h_root[:, 0])
        prop = draw_tree(root, expand, budget, params, generator, self.config.sampled_trees)
        kv.spec = kv.mask.shape[1] - past
        return prop

    def observe(
        self, completions: torch.Tensor, completion_mask: torch.Tensor, group_index: torch.Tensor
    ) -> None:
        self._kv = None  # free the rollout's cache

    def loss(self, batch: DraftTrainingBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The distillation loss on ``batch`` (optionally only ``rows``), differentiable."""
        if batch.hidden is None or batch.target_logits is None:
            raise GRPOPartsError(
                "DraftTrainingBatch.hidden/target_logits: the eagle draft needs both, got None"
            )
        sl = slice(None) if rows is None else rows
        ids, feat, tl = batch.input_ids[sl], batch.hidden[sl], batch.target_logits[sl]
        attn = (torch.ones_like(ids) if batch.attention_mask is None else batch.attention_mask[sl]).long()
        pair = attn[:, 1:] * attn[:, :-1]  # pairs (t, t+1)
        w = (batch.loss_mask[sl][:, 1:] * pair).to(feat.dtype)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, 1:]
        emb = self.embed(ids[:, 1:]).detach()  # type: ignore[operator]
        target_f = feat[:, 1:]
        target_p = torch.softmax(tl[:, 1:].to(feat.dtype), -1)
        inp = feat[:, :-1]
        total = feat.new_zeros(())
        denom = w.sum().clamp(min=1.0)
        cfg = self.config
        for _ in range(cfg.unroll):
            pred = self.head(emb, inp, attention_mask=pair, position_ids=pos).last_hidden_state
            f_loss = torch.nn.functional.smooth_l1_loss(pred, target_f, reduction="none").mean(-1)
            logq = torch.log_softmax(self._logits(pred).to(feat.dtype), -1)
            ce = -(target_p * logq).sum(-1)
            total = total + ((cfg.feature_weight * f_loss + cfg.ce_weight * ce) * w).sum() / denom
            inp = torch.cat([feat[:, :1], pred[:, :-1]], 1)  # next pass: the head's own features
        return total / cfg.unroll

    @torch.enable_grad()  # the sampler calls this from inside its no_grad rollout
    def update(self, batch: DraftTrainingBatch) -> dict[str, float]:
        self.head.train()
        n = batch.input_ids.shape[0]
        g = torch.Generator().manual_seed(self.config.seed + self.updates)
        losses = []
        for _ in range(self.config.epochs):
            order = torch.randperm(n, generator=g).to(batch.input_ids.device)
            for s in range(0, n, self.config.minibatch_rows):
                loss = self.loss(batch, order[s : s + self.config.minibatch_rows])
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.config.max_grad_norm)
                self.opt.step()
                losses.append(float(loss.detach()))
        self.updates += 1
        self.head.eval()
        return {"loss": sum(losses) / max(len(losses), 1), "updates": float(self.updates)}

    def state_dict(self) -> dict[str, Any]:
        # deep copies: a snapshot must not change when training continues (AdamW updates in place)
        return {
            "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
            "optimizer": copy.deepcopy(self.opt.state_dict()),
            "updates": self.updates,
            "config": self.config.model_dump(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"head", "optimizer", "updates"} - set(state)
        if missing:
            raise GRPOPartsError(f"state: missing entries {sorted(missing)}, got keys {sorted(state)}")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
        if "config" in state:  # hyper-parameters (and the minibatch-order seed) travel with the state
            self.config = EagleConfig(**state["config"])
