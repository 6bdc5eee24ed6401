"""Shared-prefix attention backend (Prefix Grouper, arXiv 2506.05433): the reference's log-probs and
gradients, each prompt encoded once per group. A call reads check (:mod:`.guard`; the kernel is chosen
here) -> plan (:mod:`.plan`) -> run (:mod:`.run`); what the layout cannot reach is refused, never computed
wrong (docs/attention.md, "The guard").
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import torch
from torch import nn

from ...compat import config_values
from ...errors import GRPOPartsError, NotSupportedError
from ...wrappers import calls_through
from ..protocol import PLAN_ATTENTION_CALLS, LogprobBatch, LogprobOutput
from ..vision import image_batch_reasons
from .guard import model_kind, model_reasons, refusing, text_config
from .layout import LayoutSettings
from .padding_free import LAYOUTS
from .plan import Plan, PlanSettings, make_plan
from .run import PlanRun, probe_reasons, register_attention

#: ``kernel="auto"`` tries these in order
KERNEL_PRIORITY: tuple[str, ...] = ("sdpa", "flex", "eager")


class SharedPrefixAttention:
    """Optimized ``AttentionBackend``. ``kernel``: ``"auto"`` (default), ``"sdpa"``, ``"eager"`` or
    ``"flex"`` (what each supports: :mod:`.kernels`); ``last_choice`` explains the last automatic
    choice. ``layout``: ``"grid"``, ``"padding_free"`` (:mod:`.padding_free`) or ``"auto"`` (the
    smaller estimated cost, :func:`.layout_choice.choose_layout`); ``layout_counts`` counts the calls
    of each. ``probe``: :meth:`not_supported_reasons` runs the one-token probe; the check after every
    forward runs either way. ``max_chunks`` / ``chunk_overhead_tokens``: split the groups into up to
    this many grids (``None``: 8; 1: one grid) when that saves more token slots than this per extra
    forward (:mod:`.chunking`). ``tile_elems`` / ``suffix_flash_min``: the grid ``sdpa`` kernel's
    score tiles and when its suffixes use flash (:mod:`.cascade`). ``varlen``: the padding-free
    ``sdpa`` kernel is the varlen cascade (:mod:`.varlen`), ``eager`` its plain-ops equivalent
    (:mod:`.varlen_eager`; False: a dense mask per span); ``attention_calls`` (and
    ``last_plan["attention_calls"]``) count the padding-free attention calls per path. With several
    processes (FSDP, ZeRO, DDP) the ranks of ``rank_group`` (default: all) agree on the model calls
    of each :meth:`completion_logprobs` call (:meth:`.plan.Plan.agreed`), so every rank must call it
    equally often; ``last_plan`` says what the last call did."""

    name: ClassVar[str] = "shared_prefix"

    def __init__(
        self,
        kernel: str = "auto",
        *,
        tile_elems: int = 1 << 24,
        suffix_flash_min: int = 512,
        probe: bool = True,
        max_chunks: int | None = None,
        chunk_overhead_tokens: int = 1024,
        rank_group: Any = None,
        layout: str = "auto",
        varlen: bool = True,
    ) -> None:
        from .kernels import KERNELS

        if kernel != "auto" and kernel not in (*KERNELS, "flash_varlen"):
            raise GRPOPartsError(f"kernel: expected 'auto' or one of {KERNELS}, got {kernel!r}")
        if layout != "auto" and layout not in LAYOUTS:
            raise GRPOPartsError(f"layout: expected 'auto' or one of {LAYOUTS}, got {layout!r}")
        self.kernel, self.layout = kernel, layout
        self.layout_counts: Counter[str] = Counter()
        self.varlen = varlen
        self.attention_calls: Counter[str] = Counter()
        self.tile_elems, self.suffix_flash_min = tile_elems, suffix_flash_min
        self.probe = probe
        self.max_chunks, self.chunk_overhead_tokens = max_chunks, chunk_overhead_tokens
        self.rank_group = rank_group
        self.last_choice: str = ""
        self.last_plan: dict[str, Any] = {}

    def _model_reasons(self, model: nn.Module, batch: LogprobBatch | None) -> list[str]:
        """:func:`.guard.model_reasons`; a check that itself fails (a config this code cannot read) is a
        reason, never an exception."""
        try:
            # the masks, not the batch: the batch itself passes through check, plan and run once each
            reasons = model_reasons(
                model, None if batch is None else (batch.prompt_mask, batch.completion_mask)
            )
            return reasons + image_batch_reasons(model, batch)
        except (GRPOPartsError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001
            return [f"model: {model_kind(model)}: the capability check failed: {type(e).__name__}: {e}"]

    def kernel_reasons(self, model: nn.Module, kernel: str) -> list[str]:
        from .kernels import kernel_reasons

        p = next(model.parameters())
        softcap = any(v is not None for v in config_values(text_config(model), "attn_logit_softcapping"))
        # attention sinks (gpt-oss and others): a ``sinks`` tensor on the attention modules
        sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
        grad = torch.is_grad_enabled()
        return kernel_reasons(kernel, device=p.device, dtype=p.dtype, softcap=softcap, grad=grad, sinks=sinks)

    def _kernels(self, model: nn.Module) -> tuple[str | None, dict[str, list[str]]]:
        """``(the kernel to run, why the ones tried before it were refused)``: ``self.kernel``, or the
        first supported in :data:`KERNEL_PRIORITY`; None when every one tried is refused."""
        refused: dict[str, list[str]] = {}
        for k in KERNEL_PRIORITY if self.kernel == "auto" else (self.kernel,):
            reasons = self.kernel_reasons(model, k)
            if not reasons:
                return k, refused
            refused[k] = reasons
        return None, refused

    def _refused(self, refused: dict[str, list[str]]) -> list[str]:
        if self.kernel != "auto":
            return refused[self.kernel]
        return [f"{n}: {'; '.join(r)}" for n, r in refused.items()]

    def choose_kernel(self, model: nn.Module) -> str:
        """:meth:`_kernels`' kernel (raising when there is none); sets :attr:`last_choice` to why."""
        kernel, refused = self._kernels(model)
        if kernel is None:
            raise NotSupportedError(f"shared_prefix[{self.kernel}]", self._refused(refused))
        lines = [f"chose kernel {kernel!r}"] + [f"refused {n!r}: {'; '.join(r)}" for n, r in refused.items()]
        self.last_choice = f"kernel {kernel!r} (requested)" if self.kernel != "auto" else "\n".join(lines)
        return kernel

    def not_supported_reasons(self, model: nn.Module, batch: LogprobBatch | None = None) -> list[str]:
        """The static checks, then (``probe``) one forward on a one-token probe, cached per model, proving
        that the layout reaches every decoder layer (:func:`.run.probe_reasons`)."""
        model = calls_through(model)
        out = self._model_reasons(model, batch)
        if not out:
            kernel, refused = self._kernels(model)
            out = self._refused(refused) if kernel is None else []
        if not out and self.probe:
            out = probe_reasons(model)
        return out

    def register_kernel(self) -> str | None:
        return register_attention()

    def plan(
        self, model: nn.Module, batch: LogprobBatch, *, packed: bool = False, agree: bool = True
    ) -> Plan:
        """What :meth:`completion_logprobs` runs for ``batch``: kernel, layout, model calls, tokens
        (:mod:`.plan`). ``packed``: bound the grid by the packed rows (adapters fed packed rows);
        ``agree=False``: no all-reduce of the call count -- the caller agrees with the other ranks
        and calls :meth:`.plan.Plan.agreed`."""
        model = calls_through(model)
        kernel = self.choose_kernel(model)
        ctxs = [c for c in config_values(text_config(model), "max_position_embeddings") if isinstance(c, int)]
        build = LayoutSettings(
            kernel=kernel, max_positions=min(ctxs) if ctxs else None, tile_elems=self.tile_elems,
            suffix_flash_min=self.suffix_flash_min, varlen=self.varlen,
        )  # fmt: skip
        max_chunks = 8 if self.max_chunks is None else self.max_chunks  # (several ranks: Plan.agreed)
        # image prompts run in grids (the padding-free layout packs rows past the images' keywords), and
        # keep their group numbering (packed sub-groups would renumber the prompts their images follow)
        layout = self.layout if batch.vision is None else "grid"
        if batch.vision is not None and packed:
            raise NotSupportedError(
                "shared_prefix", ["LogprobBatch.vision: packed rows with images are not served"]
            )
        settings = PlanSettings(
            self.last_choice, layout, max_chunks, self.chunk_overhead_tokens, text_config(model), build
        )
        with refusing("planning the call", model):
            return make_plan(batch, settings, packed=packed, agree=agree, rank_group=self.rank_group)

    def run(
        self,
        model: nn.Module,
        batch: LogprobBatch,
        plan: Plan,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> LogprobOutput:
        """Run ``plan`` (from :meth:`plan` on this ``batch``) and record it in :attr:`last_plan`,
        :attr:`layout_counts` and :attr:`attention_calls`."""
        model = calls_through(model)
        register_attention()
        run = PlanRun(model, plan, temperature, compute_entropy)
        out = run(batch)
        self.last_plan = {**plan.info(), PLAN_ATTENTION_CALLS: run.attention_calls}
        if run.masked_why:
            self.last_plan["masked_sdpa_why"] = "; ".join(run.masked_why)
        self.layout_counts[plan.layout] += 1
        self.attention_calls.update(run.attention_calls)
        return out

    def completion_logprobs(
        self, model: nn.Module, batch: LogprobBatch, temperature: float = 1.0, compute_entropy: bool = False
    ) -> LogprobOutput:
        """Log-probs (and entropies) of ``batch``'s completions, equal to the reference's: check,
        :meth:`plan`, :meth:`run`. ``model`` may be wrapped (DDP, FSDP1, DeepSpeed's engine): the
        inner model is inspected, every forward runs through the wrapper (:mod:`grpo_parts.wrappers`).
        A model the capability check accepts either computes or raises :class:`NotSupportedError`
        naming the stage that failed (:func:`.guard.refusing`), never a raw exception."""
        model = calls_through(model)
        reasons = self._model_reasons(model, batch)
        if reasons:
            raise NotSupportedError("shared_prefix", reasons)
        return self.run(model, batch, self.plan(model, batch), temperature, compute_entropy)
