"""Shared-prefix attention backend (Prefix Grouper, arXiv 2506.05433): each prompt is encoded
once per group instead of once per completion, with the same log-probs and gradients as
:class:`~grpo_parts.attention.reference.RepeatedPrefixAttention`.

``completion_logprobs`` reads check -> plan -> run: the capability check (here and
:mod:`.guard`), one :class:`~.plan.Plan` of the call (:mod:`.plan`: kernel, layout, model calls),
and its run (:mod:`.run`): the rows regrouped by ``group_index`` (:mod:`.layout`,
:mod:`.padding_free`), the model run with this package's attention function (:mod:`.kernels`)
selected for the duration of the call, logits only where they predict a completion token (the last
prefix token's logit is shared by every completion of the group), un-grouped and merged.

The layout reaches the attention function as an extra keyword argument of ``model(...)``, which
transformers forwards to every ``AttentionInterface`` function. A 4-D placeholder
``attention_mask`` makes transformers skip building a dense mask that the kernels would ignore.
Architectures where that does not hold are refused, never computed wrong (:mod:`.guard`): after
every forward each decoder layer must have received the layout, checked once per model on a
one-token probe by :meth:`SharedPrefixAttention.not_supported_reasons` too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import torch

from ...compat import accepts_logits_to_keep, config_values, select_attention
from ...errors import GRPOPartsError, NotSupportedError
from ...wrappers import calls_through, inner_model, model_name
from ..protocol import PLAN_ATTENTION_CALLS, LogprobBatch, LogprobOutput
from .grouped_forward import KERNEL_NAME, probe_reasons, register_attention
from .guard import any_value, architecture_reasons, model_kind, position_tables, refusing, text_config
from .padding_free import LAYOUTS
from .plan import Plan, PlanSettings, make_plan
from .run import PlanRun

# KERNEL_NAME, register_attention and select_attention are re-exported for the adapters and tests
__all__ = [
    "KERNEL_NAME",
    "KERNEL_PRIORITY",
    "SharedPrefixAttention",
    "probe_reasons",
    "register_attention",
    "select_attention",
]

#: ``kernel="auto"`` tries these in order
KERNEL_PRIORITY: tuple[str, ...] = ("sdpa", "flex", "eager")


def _through_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``(the model whose forward gets our keyword arguments, reasons)``. A PEFT model with a weight
    adapter (LoRA and the like) passes ``logits_to_keep``, ``position_ids`` and the layout keyword
    unchanged to its base model; prompt-learning adapters add virtual tokens and activated LoRA looks
    for its invocation tokens in ``input_ids``, neither of which holds in the grouped layout. DDP,
    FSDP1 and DeepSpeed's engine pass every keyword argument on to the module they wrap
    (:func:`~grpo_parts.wrappers.inner_model`)."""
    model = inner_model(model)
    get_base = getattr(model, "get_base_model", None)
    cfg = getattr(model, "active_peft_config", None)
    if not callable(get_base) or cfg is None:
        return model, []
    if getattr(cfg, "is_prompt_learning", False):
        return model, [f"model: PEFT {cfg.peft_type} adds virtual tokens (prompt learning)"]
    if getattr(cfg, "alora_invocation_tokens", None):
        return model, ["model: activated LoRA (alora_invocation_tokens) reads its invocation from input_ids"]
    return get_base(), []


class SharedPrefixAttention:
    """Optimized ``AttentionBackend``. ``kernel``: ``"auto"`` (default), ``"sdpa"``, ``"eager"``,
    ``"flex"``; see :mod:`.kernels` for what each supports. ``last_choice`` explains the last
    automatic choice. ``probe``: :meth:`not_supported_reasons` runs the one-token probe
    (:func:`probe_reasons`); the check after every forward runs either way. ``max_chunks`` /
    ``chunk_overhead_tokens``: the groups may be split into up to this many grids when that saves more
    token slots than this per extra forward (:mod:`.chunking`; 1 = always one grid; ``None`` = 8). With several processes
    (FSDP, ZeRO, DDP) the ranks of ``rank_group`` (default: all) agree on the number of model calls
    per call of :meth:`completion_logprobs` (:func:`.chunking.rank_consistent_plan`), so every rank
    must call it equally often; ``last_plan`` says what the last call did. ``layout``: ``"grid"``,
    ``"padding_free"`` (:mod:`.padding_free`) or ``"auto"`` (:func:`.layout_choice.choose_layout`:
    smaller estimated cost); ``layout_counts`` counts the calls of each. ``varlen``: the padding-free
    ``sdpa`` kernel is the varlen cascade (:mod:`.varlen`), ``eager`` its plain-ops equivalent
    (:mod:`.varlen_eager`; False: a dense mask per span, masked SDPA / eager); ``attention_calls``
    (and ``last_plan["attention_calls"]``) count the padding-free attention calls per path."""

    name: ClassVar[str] = "shared_prefix"

    def __init__(
        self,
        kernel: str = "auto",
        *,
        chunk_elems: int = 1 << 24,
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
        self.chunk_elems = chunk_elems
        self.suffix_flash_min = suffix_flash_min
        self.probe = probe
        self.chunk_overhead_tokens = chunk_overhead_tokens
        self.max_chunks = max_chunks
        self.rank_group = rank_group
        self.last_choice: str = ""
        #: how the last call split the groups into grids (:func:`.chunking.chunk_plan`'s info)
        self.last_plan: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ capabilities

    def _model_reasons(self, model: torch.nn.Module, batch: LogprobBatch | None) -> list[str]:
        """:meth:`_static_reasons`; a check that itself fails (a config this code cannot read) is a
        reason, never an exception."""
        try:
            return self._static_reasons(model, batch)
        except (GRPOPartsError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001
            return [f"model: {model_kind(model)}: the capability check failed: {type(e).__name__}: {e}"]

    def _static_reasons(self, model: torch.nn.Module, batch: LogprobBatch | None) -> list[str]:
        cfg = getattr(model, "config", None)
        if cfg is None:
            return [f"model: expected a transformers causal LM with .config, got {model_name(model)}"]
        if any_value(cfg, "is_encoder_decoder"):
            return [f"model: encoder-decoder models ({cfg.model_type}) are not supported"]
        tc = text_config(model)
        out = []
        if not all(config_values(tc, "is_causal", True)) or any_value(tc, "use_bidirectional_attention"):
            out.append(f"model: {tc.model_type} uses bidirectional attention")
        base, peft_reasons = _through_peft(model)
        out += peft_reasons
        if not accepts_logits_to_keep(base):
            out.append(f"model: {model_name(base)}.forward has no logits_to_keep argument")
        out += architecture_reasons(model, base)
        windows = [w for w in config_values(tc, "sliding_window") if isinstance(w, int)]
        window = min(windows) if windows else None  # (per layer in a heterogeneous config)
        uses_window = window is not None and (
            any_value(tc, "use_sliding_window", True)
            or "sliding_attention" in (config_values(tc, "layer_types")[0] or [])
        )
        tables = position_tables(base)
        if batch is not None and (tables or uses_window):  # (a host sync: only where it can matter)
            span = int((batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)).max())
            out += [
                f"model: learned position table {name} holds {rows} positions; the longest row needs {span}"
                for name, rows in tables
                if span > rows
            ]
            if uses_window and window is not None and span > window:
                out.append(
                    f"model: sliding window {window} < longest sequence ({span} tokens) is not implemented"
                )
        if model.training and any(float(v or 0.0) > 0.0 for v in config_values(tc, "attention_dropout", 0.0)):
            out.append(
                "model: attention dropout > 0 in training mode (randomness cannot match the reference)"
            )
        return out

    def _softcap(self, model: torch.nn.Module) -> bool:
        return any(v is not None for v in config_values(text_config(model), "attn_logit_softcapping"))

    def _sinks(self, model: torch.nn.Module) -> bool:
        """Attention sinks (gpt-oss and others: a ``sinks`` tensor on the attention modules)."""
        return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())

    def kernel_reasons(self, model: torch.nn.Module, kernel: str) -> list[str]:
        from .kernels import kernel_reasons

        p = next(model.parameters())
        return kernel_reasons(
            kernel,
            device=p.device,
            dtype=p.dtype,
            softcap=self._softcap(model),
            grad=torch.is_grad_enabled(),
            sinks=self._sinks(model),
        )

    def choose_kernel(self, model: torch.nn.Module) -> str:
        """The kernel to run (``self.kernel`` or the first supported in :data:`KERNEL_PRIORITY`);
        sets :attr:`last_choice` to an explanation."""
        if self.kernel != "auto":
            reasons = self.kernel_reasons(model, self.kernel)
            if reasons:
                raise NotSupportedError(f"shared_prefix[{self.kernel}]", reasons)
            self.last_choice = f"kernel {self.kernel!r} (requested)"
            return self.kernel
        refused: dict[str, list[str]] = {}
        for k in KERNEL_PRIORITY:
            reasons = self.kernel_reasons(model, k)
            if not reasons:
                lines = [f"chose kernel {k!r}"] + [
                    f"refused {n!r}: {'; '.join(r)}" for n, r in refused.items()
                ]
                self.last_choice = "\n".join(lines)
                return k
            refused[k] = reasons
        raise NotSupportedError("shared_prefix[auto]", [f"{n}: {'; '.join(r)}" for n, r in refused.items()])

    def not_supported_reasons(self, model: torch.nn.Module, batch: LogprobBatch | None = None) -> list[str]:
        """Why this backend cannot run ``model`` (and ``batch``); empty = supported. With ``probe``
        (the constructor's, default True) a model that passes the static checks is run once on a
        one-token probe (cached per model, :func:`probe_reasons`) to prove that the layout reaches
        every decoder layer. ``model`` may be wrapped (DDP, FSDP1, DeepSpeed: :mod:`grpo_parts.wrappers`)."""
        model = calls_through(model)
        out = self._model_reasons(model, batch)
        if out:
            return out
        if self.kernel != "auto":
            out = self.kernel_reasons(model, self.kernel)
        else:
            per = {k: self.kernel_reasons(model, k) for k in KERNEL_PRIORITY}
            if all(per.values()):
                out = [f"{k}: {'; '.join(r)}" for k, r in per.items()]
        if not out and self.probe:
            out = probe_reasons(model)
        return out

    def register_kernel(self) -> str | None:
        return register_attention()

    # ------------------------------------------------------------------------------- plan, run

    def plan(
        self, model: torch.nn.Module, batch: LogprobBatch, *, packed: bool = False, agree: bool = True
    ) -> Plan:
        """What :meth:`completion_logprobs` runs for ``batch``: kernel, layout, model calls, tokens
        (:mod:`.plan`). ``packed``: bound the grid by the packed rows (adapters fed packed rows);
        ``agree=False``: no all-reduce of the call count -- the caller agrees with the other ranks
        and calls :meth:`.plan.Plan.agreed`."""
        model = calls_through(model)
        kernel = self.choose_kernel(model)
        ctxs = [c for c in config_values(text_config(model), "max_position_embeddings") if isinstance(c, int)]
        settings = PlanSettings(
            kernel, self.last_choice, self.layout, self.varlen, self.chunk_limit(), self.chunk_overhead_tokens,
            self.chunk_elems, self.suffix_flash_min, min(ctxs) if ctxs else None, text_config(model),
        )  # fmt: skip
        with refusing("planning the call", model):
            return make_plan(batch, settings, packed=packed, agree=agree, rank_group=self.rank_group)

    def run(
        self,
        model: torch.nn.Module,
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
        self,
        model: torch.nn.Module,
        batch: LogprobBatch,
        temperature: float = 1.0,
        compute_entropy: bool = False,
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

    def chunk_limit(self, model: torch.nn.Module | None = None) -> int:
        """``max_chunks``, or 8 for ``None``. Under FSDP/ZeRO/DDP every forward runs collectives; the
        ranks agree on the number of model calls (:meth:`.plan.Plan.agreed`)."""
        return 8 if self.max_chunks is None else self.max_chunks
