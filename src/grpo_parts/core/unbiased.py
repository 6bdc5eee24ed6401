"""The one rule that keeps a weighted loss unbiased -- stated here and nowhere else.

Rows kept at random with probability ``p`` and weighted ``1 / p`` (``dppo``'s completion filter, or
prompt skipping before rollout) give a loss whose expectation over the draw is the full batch's
exactly when:

1. **every term of a row's loss is multiplied by its weight** -- no KL penalty, entropy bonus or
   auxiliary term the weight leaves out (``unscaled``), and no term that carries gradient on rows
   the draw never keeps (``unkept``);
2. **each row's term depends on its own group only** -- no advantage statistics of the whole batch
   (``batch_statistics``), which the draw changes;
3. **the normaliser is fixed before the draw** and counts what the full batch's loss counts: a
   filter's weights take the whole rolled-out batch's token / sequence counts (known after rollout,
   :func:`grpo_parts.filter.apply.loss_denominators`); skipping's take the *drawn* prompts'
   ``rows x G``, so a token count (never generated for a skipped prompt) cannot be used, and the
   sequence count must count rows without a completion token if any can occur (``seq_count``);
4. **nothing else depends on the draw**: no refill round (how many, which rows trimmed), no
   normaliser a framework computes from the kept rows (``normaliser_from_draw``).

Each door (``grpo-parts train``, the public recipe, TRL, verl, OpenRLHF) maps its own configuration
into :class:`WeightedLossFacts`, naming each fact by its own setting and fix, and refuses with
:func:`refusal_reasons` (tests/core/test_unbiased.py and tests/skip/test_prompt_skip.py enumerate every
draw to prove the accepted cases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Fact", "WeightedLossFacts", "loss_facts", "refusal_reasons"]

#: a door's setting that makes a fact hold, and what to set instead: ``("beta=0.1", "set beta=0.0")``
Fact = tuple[str, str]


@dataclass(frozen=True)
class WeightedLossFacts:
    """What decides whether ``1 / p`` row weights keep a door's loss unbiased (module docstring).
    ``source``: what weights the rows, as messages name it (``"dppo"``, ``"prompt skipping"``).
    ``normaliser``: ``"rolled_out"`` (a filter: the whole rolled-out batch's counts) or ``"drawn"``
    (skipping: the drawn prompts' rows). ``token_normalised``: loss terms divided by a token count.
    ``seq_count``: the setting under which the loss's sequence count skips rows without a completion token,
    when such rows can occur (None: it counts every row, or none can occur)."""

    source: str
    normaliser: Literal["rolled_out", "drawn"] = "rolled_out"
    refill: Fact | None = None
    unscaled: tuple[Fact, ...] = ()
    unkept: tuple[Fact, ...] = ()
    batch_statistics: tuple[Fact, ...] = ()
    normaliser_from_draw: tuple[Fact, ...] = ()
    token_normalised: tuple[Fact, ...] = ()
    seq_count: Fact | None = None


def refusal_reasons(f: WeightedLossFacts) -> list[str]:
    """Why ``f``'s weighted loss would not be an unbiased estimate of the full batch's (empty: it is).
    One sentence per fact: ``"<setting>: <why>; <fix>"``."""
    out = []
    if f.refill is not None:
        out.append(
            f"{f.refill[0]}: {f.source} keeps rows at random, and a refill round (how many, which rows "
            f"trimmed) would depend on that draw, which biases the estimate; {f.refill[1]}"
        )
    out += [f"{s}: a loss term the {f.source} weight does not scale; {fix}" for s, fix in f.unscaled]
    out += [f"{s}: rows the draw never keeps still carry this term's gradient, so {f.source} biases it; {fix}" for s, fix in f.unkept]  # fmt: skip
    out += [
        f"{s}: every group is scaled by statistics of the whole batch, which {f.source} changes (biased); {fix}"
        for s, fix in f.batch_statistics
    ]
    out += [
        f"{s}: the normaliser depends on which rows were kept, which biases the estimate; {fix}"
        for s, fix in f.normaliser_from_draw
    ]
    if f.normaliser == "drawn":
        out += [
            f"{s}: divides by the drawn batch's token count, unknown for skipped prompts (never generated); {fix}"
            for s, fix in f.token_normalised
        ]
        if f.seq_count is not None:
            out.append(
                f"{f.seq_count[0]}: the loss counts only rows with a completion token, and the drawn batch's "
                f"count of those is unknown for skipped prompts; {f.seq_count[1]}"
            )
    return out


def loss_facts(
    loss: object, source: str, normaliser: Literal["rolled_out", "drawn"] = "rolled_out",
    empty_rows: bool = True, prefix: str = "",
) -> WeightedLossFacts:  # fmt: skip
    """The facts of a :class:`~grpo_parts.core.LossConfig` (``prefix``: how the door names its
    fields, e.g. ``"loss."``). ``empty_rows``: rows without a completion token can occur (a trainer
    whose sampler always emits one says False)."""
    from .config import LossConfig

    assert isinstance(loss, LossConfig)
    p = prefix
    draw_dependent: list[Fact] = []
    if loss.agg == "seq-mean-token-sum-norm" and loss.norm_constant is None:
        setting = f"{p}agg='seq-mean-token-sum-norm' without {p}norm_constant"
        width = f"its default is the padded width of the kept rows; set {p}norm_constant"
        draw_dependent.append((setting, f"{width} (Dr. GRPO: the max completion length)"))
    fix = f"expected {p}agg 'seq-mean-token-mean', or 'seq-mean-token-sum-norm' with {p}norm_constant"
    tokens = [
        (f"{p}{name}='token-mean'", fix)
        for name, on in (
            ("agg", loss.agg == "token-mean"),
            ("kl_agg", loss.kl_coef > 0 and loss.kl_agg == "token-mean"),
            ("entropy_agg", loss.entropy_coef > 0 and loss.entropy_agg == "token-mean"),
        )
        if on
    ]
    seq = None
    if empty_rows and loss.agg != "token-mean" and loss.seq_count == "nonempty":
        seq = (f"{p}seq_count='nonempty'", f"set {p}seq_count='all' (every drawn row counts)")
    return WeightedLossFacts(
        source=source,
        normaliser=normaliser,
        normaliser_from_draw=tuple(draw_dependent),
        token_normalised=tuple(tokens),
        seq_count=seq,
    )
