"""``grpo-parts bench attention``: shared-prefix vs repeated-prefix forward+backward.

Per point (G completions of one P-token prompt, S tokens each) one forward+backward of
``sum(w * logprobs)`` through a small Qwen2-style model: ``reference`` (:class:`RepeatedPrefixAttention`),
``shared`` (:class:`SharedPrefixAttention`) and ``dense`` (the shared row with a dense 4-D mask through
SDPA: the Prefix Grouper layout without a dedicated kernel). Peak memory: the max running sum of
torch's CPU allocator events (``torch.profiler``) in a separate step, parameters excluded.

``--vlm``: a Qwen2-VL policy instead, each prompt one square image of ``P`` image tokens between two
16-token texts, its vision tower in every forward and backward (the reference runs it per completion,
the shared prefix once per group); no dense variant.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from ._args import add_common

FULL_GRID = [(g, p, s) for p in (256, 1024, 4096) for s in (64, 256, 1024) for g in (4, 8, 16)]
ACCEPTANCE = (8, 1024, 128)
QUICK_GRID = [(4, 256, 64), ACCEPTANCE]
#: ``--vlm``: (G, image tokens, S)
VLM_GRID = [(8, p, s) for p in (256, 1024) for s in (64, 256)]
VLM_TEXT = 16  # text tokens before and after the image


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(
        parser, quick=f"only {QUICK_GRID} (G, P, S) (CI-speed)", summary="the fastest reported",
        model="model", hidden=256, layers=4, vocab=512,
    )  # fmt: skip
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument(
        "--kv-heads", type=int, default=2, help="key/value heads, grouped-query (default: %(default)s)"
    )
    parser.add_argument(
        "--intermediate", type=int, default=1408,
        help="MLP width (Qwen2 uses ~5.5x hidden; default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-ref-tokens", type=int, default=40_000,
        help="skip points whose reference batch G*(P+S) exceeds this (memory guard; reported as skipped)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu",
        help="torch device of the model and batches, e.g. cuda (default: %(default)s); on CUDA the peak "
        "memory is torch.cuda.max_memory_allocated above the weights",
    )  # fmt: skip
    parser.add_argument(
        "--vlm", action="store_true",
        help=f"a Qwen2-VL policy, one image of P tokens per prompt, vision tower included; grid {VLM_GRID} "
        "(--quick: its first point)",
    )  # fmt: skip
    parser.add_argument(
        "--max-dense-tokens", type=int, default=12_000,
        help="skip the dense-mask variant above this row length",
    )  # fmt: skip


def ideal_ratio(g: int, p: int, s: int) -> float:
    """Token reduction ``G(P+S) / (P + G*S)``."""
    return g * (p + s) / (p + g * s)


def _peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    if device.type == "cuda":  # the allocator's own peak, above what is allocated before the step
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    run = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        run += e.nbytes()
        peak = max(peak, run)
    return peak


def _time(fn: Callable[[], Any], repeats: int, clock: str = "wall") -> float:
    """Fastest of ``repeats`` runs after one warm-up (interference from other processes only adds)."""
    now = time.perf_counter if clock == "wall" else time.process_time
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = now()
        fn()
        ts.append(now() - t0)
    return min(ts)


def _dense_logprobs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Single grouped row + dense additive 4-D mask through the model's own (SDPA) attention."""
    from ..attention.shared_prefix.layout import build_grouped_inputs
    from ..attention.shared_prefix.run import ungroup_logits
    from ..core import token_logprobs

    gi = build_grouped_inputs(batch)
    lay = gi.layout
    length = lay.row_len
    idx = torch.arange(length, device=gi.input_ids.device)
    seg = torch.where(idx < lay.prefix_len, 0, (idx - lay.prefix_len) // max(lay.slot_len, 1) + 1)
    allowed = ((seg[None, :] == seg[:, None]) & (idx[None, :] <= idx[:, None])) | (
        (seg[None, :] == 0) & (seg[:, None] > 0)
    )
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(length, length, dtype=dtype, device=idx.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    mask = mask.expand(gi.input_ids.shape[0], 1, length, length)
    out = model(
        input_ids=gi.input_ids, position_ids=gi.position_ids, attention_mask=mask, logits_to_keep=gi.keep
    )
    logits = ungroup_logits(out.logits, gi)
    return token_logprobs(logits, batch.completion_ids[:, : logits.shape[1]])


def _point_batch(g: int, p: int, s: int, args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    """One prompt of ``p`` tokens repeated ``g`` times with random ``s``-token completions, and the
    per-token weights of the loss (drawn in this order from one generator seeded by the point)."""
    from ..attention.protocol import LogprobBatch

    gen = torch.Generator().manual_seed(args.seed + g * 7 + p * 13 + s)
    vocab = args.vocab
    prompt = torch.randint(1, vocab, (1, p), generator=gen).repeat(g, 1)
    batch = LogprobBatch(
        prompt, torch.ones(g, p, dtype=torch.long), torch.randint(1, vocab, (g, s), generator=gen),
        torch.ones(g, s, dtype=torch.long), torch.zeros(g, dtype=torch.long),
    )  # fmt: skip
    return batch, torch.rand(g, s, generator=gen)


def _vlm_point_batch(
    model: torch.nn.Module, g: int, p: int, s: int, args: argparse.Namespace
) -> tuple[Any, torch.Tensor]:
    """:func:`_point_batch` for ``--vlm``: one prompt of ``VLM_TEXT`` text tokens, a square image of
    ``p`` tokens, ``VLM_TEXT`` more, with its image keywords once."""
    from ..attention.protocol import LogprobBatch
    from ..tiny_vision import tiny_image
    from ..types import VisionInputs

    gen = torch.Generator().manual_seed(args.seed + g * 7 + p * 13 + s)
    side = int(round(p**0.5))
    text = args.vocab - 4  # tiny_vision reserves the last 4 ids
    image, inputs = tiny_image(model, 1, gen, tokens=(side, side))
    ids = torch.randint(1, text, (VLM_TEXT,), generator=gen).tolist() + image
    ids += torch.randint(1, text, (VLM_TEXT,), generator=gen).tolist()
    prompt = torch.tensor([ids]).repeat(g, 1)
    batch = LogprobBatch(
        prompt, torch.ones_like(prompt), torch.randint(1, text, (g, s), generator=gen),
        torch.ones(g, s, dtype=torch.long), torch.zeros(g, dtype=torch.long), VisionInputs((inputs,)),
    )  # fmt: skip
    return batch, torch.rand(g, s, generator=gen)


def _train_step(
    model: torch.nn.Module, w: torch.Tensor, lp_fn: Callable[[], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """One forward+backward of ``sum(w * logprobs)`` with ``lp_fn``'s logprobs; returns them (on
    CUDA after the device finished, so a timer around it measures the step)."""

    def f() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        lp = lp_fn()
        (lp * w).sum().backward()
        if lp.device.type == "cuda":
            torch.cuda.synchronize(lp.device)
        return lp.detach()

    return f


def _to(batch: Any, w: torch.Tensor, device: torch.device) -> tuple[Any, torch.Tensor]:
    """``batch`` (a LogprobBatch, its images too) and the weights ``w`` on ``device``."""
    from dataclasses import replace

    moved = {
        f: getattr(batch, f).to(device)
        for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group_index")
    }
    if batch.vision is not None:
        moved["vision"] = batch.vision.to(device)
    return replace(batch, **moved), w.to(device)


def _dense_columns(
    times: dict[str, float], peaks: dict[str, int], lps: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The dense-mask variant's columns, relative to ``shared`` (speed, memory) and ``ref`` (logprobs)."""
    return dict(
        speedup_vs_dense=round(times["dense"] / times["shared"], 4),
        memory_ratio_vs_dense=round(peaks["dense"] / max(peaks["shared"], 1), 4),
        time_dense_s=round(times["dense"], 4),
        peak_dense_mb=round(peaks["dense"] / 2**20, 1),
        max_abs_logprob_diff_dense=float((lps["dense"] - lps["ref"]).abs().max()),
    )


def run_point(model: torch.nn.Module, g: int, p: int, s: int, args: argparse.Namespace) -> dict[str, Any]:
    from ..attention.reference import RepeatedPrefixAttention
    from ..attention.shared_prefix.backend import SharedPrefixAttention

    batch, w = _vlm_point_batch(model, g, p, s, args) if args.vlm else _point_batch(g, p, s, args)
    device = next(model.parameters()).device
    batch, w = _to(batch, w, device)
    p_all = int(batch.prompt_ids.shape[1])  # --vlm: the image's tokens and the text around them
    row: dict[str, Any] = {"G": g, "P": p_all, "S": s, "ideal": round(ideal_ratio(g, p_all, s), 4)}
    if args.vlm:  # the tower's patches counted as tokens too: G copies in the reference, 1 shared
        patches = int(batch.vision.per_prompt[0]["pixel_values"].shape[0])  # type: ignore[union-attr]
        row.update(image_tokens=p, patches=patches)
        row["ideal_with_tower"] = round(ideal_ratio(g, p_all + patches, s), 4)
    if g * (p_all + s) > args.max_ref_tokens:
        row.update(
            speedup=None,
            memory_ratio=None,
            max_abs_logprob_diff=None,
            skipped=f"reference batch {g * (p + s)} tokens > --max-ref-tokens {args.max_ref_tokens}",
        )
        return row
    p = p_all
    ref, shared = RepeatedPrefixAttention(), SharedPrefixAttention("auto")
    variants = {
        "ref": _train_step(model, w, lambda: ref.completion_logprobs(model, batch).logprobs),
        "shared": _train_step(model, w, lambda: shared.completion_logprobs(model, batch).logprobs),
    }
    if p + g * s <= args.max_dense_tokens and not args.vlm:
        variants["dense"] = _train_step(model, w, lambda: _dense_logprobs(model, batch))
    lps = {k: f() for k, f in variants.items()}
    times = {k: _time(f, args.repeats, args.clock) for k, f in variants.items()}
    peaks = {k: _peak_bytes(f, device) for k, f in variants.items()}
    row.update(
        speedup=round(times["ref"] / times["shared"], 4),
        memory_ratio=round(peaks["ref"] / max(peaks["shared"], 1), 4),
        max_abs_logprob_diff=float((lps["shared"] - lps["ref"]).abs().max()),
        efficiency=round(times["ref"] / times["shared"] / ideal_ratio(g, p, s), 4),
        time_ref_s=round(times["ref"], 4),
        time_shared_s=round(times["shared"], 4),
        peak_ref_mb=round(peaks["ref"] / 2**20, 1),
        peak_shared_mb=round(peaks["shared"] / 2**20, 1),
        kernel=shared.last_choice.splitlines()[0] if shared.last_choice else "",
    )
    if "dense" in variants:
        row.update(_dense_columns(times, peaks, lps))
    return row


def _fmt(v: Any, nd: int = 2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def run(args: argparse.Namespace) -> int:
    from ..tiny import tiny_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    grid = (
        QUICK_GRID if args.quick else sorted(set(FULL_GRID) | {ACCEPTANCE}, key=lambda t: (t[1], t[2], t[0]))
    )
    if args.vlm:
        return _run_grid(_vlm_model(args), VLM_GRID[:1] if args.quick else VLM_GRID, args)
    model = tiny_causal_lm(
        "qwen2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, max_position_embeddings=8192,
        dtype=torch.float32, seed=args.seed, attn_implementation="sdpa",
    )  # fmt: skip
    # attention_dropout is 0: train mode changes nothing but is what an update uses
    model.to(args.device).train()
    print(
        f"model: qwen2 hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"intermediate={args.intermediate} vocab={args.vocab} float32; torch threads={torch.get_num_threads()}; "
        f"clock={args.clock}, fastest of {args.repeats} after a warm-up"
    )
    return _run_grid(model, grid, args)


def _vlm_model(args: argparse.Namespace) -> torch.nn.Module:
    from ..tiny_vision import tiny_vlm

    model = tiny_vlm(
        "qwen2_vl", vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads, num_layers=args.layers, vision_layers=args.layers,
        vision_hidden=args.hidden // 2, seed=args.seed,
    )  # fmt: skip
    model.to(args.device).train()
    print(
        f"model: qwen2_vl hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"MLP {2 * args.hidden} vocab={args.vocab}, vision tower {args.layers} layers wide {args.hidden // 2} "
        f"(2x2 patches merged per image token) float32 on {args.device}; torch threads={torch.get_num_threads()}; "
        f"clock={args.clock}, fastest of {args.repeats} after a warm-up"
    )
    return model


def _run_grid(model: torch.nn.Module, grid: list[tuple[int, int, int]], args: argparse.Namespace) -> int:
    from tqdm import tqdm

    header = "   G     P     S  ideal  speedup  eff  mem_ratio  vs_dense  max|dlogp|  t_ref(s) t_shared(s)"
    rows = []
    tqdm.write(header)
    bar = tqdm(grid, desc="attention bench", leave=False)
    for g, p, s in bar:
        bar.set_postfix(G=g, P=p, S=s)
        row = run_point(model, g, p, s, args)
        rows.append(row)
        diff = row["max_abs_logprob_diff"]
        tqdm.write(
            f"{g:4d} {row['P']:5d} {s:5d} {row['ideal']:6.2f} {_fmt(row['speedup']):>8} {_fmt(row.get('efficiency')):>4} "
            f"{_fmt(row['memory_ratio']):>10} {_fmt(row.get('speedup_vs_dense')):>9} "
            f"{'-' if diff is None else format(diff, '.1e'):>10} "
            f"{_fmt(row.get('time_ref_s'), 3):>9} {_fmt(row.get('time_shared_s'), 3):>11}"
            + (f"  ({row['skipped']})" if "skipped" in row else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0
