#!/usr/bin/env python
"""Actor-update time and peak memory in verl 0.9.1's FSDP engine: verl's forward, verl's own Prefix
Grouper and grpo_parts' shared prefix, on the same model and batch (docs/history/benchmarks-log.md,
"verl").

Each variant runs in its own process (peak RSS is a per-process high-water mark) on verl's
``FSDPEngineWithLMHead`` (FSDP2, one rank; on a CPU-only host verl's device helpers are pointed at
CPU as in tests/adapters/verl/_cpu_verl.py). An update is verl's ``train_batch``: zero grad, forward
+ ``ppo_loss`` + backward over the micro-batches, AdamW step.

* ``verl_padded`` / ``verl_packed``: verl's own forward, ``use_remove_padding`` off / on (on a CPU,
  verl's packed forward runs SDPA with a dense block-diagonal mask; GPUs use flash-attn varlen);
* ``verl_pg``: verl's Prefix Grouper (``verl.trainer.ppo.prefix_grouper_utils``, needs
  ``pip install prefix-grouper``). verl 0.9.1 never calls it (``actor.use_prefix_grouper`` only
  changes the legacy trainer's balancing), so it is put in as the engine's ``forward_step`` here,
  with ``apply_prefix_grouper_patch()`` as ``apply_monkey_patch(use_prefix_grouper=True)`` would;
  padded micro-batches of whole groups, as it requires;
* ``ours`` / ``ours_one_call``: ``+actor_rollout_ref.actor.grpo_parts.attention=shared_prefix``
  (the backend's plan of each micro-batch / ``max_chunks=1``: one grid per micro-batch).

    python scripts/measure/verl_prefix_bench.py --repeats 5        # prints a markdown table and JSON

Times come from one process holding every variant's engine (same weights), updates interleaved
round-robin so a changing machine load hits all alike; peak memory from one process per variant
(CPU: RSS high-water mark; GPU: ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("verl_padded", "verl_packed", "verl_pg", "ours", "ours_one_call")


def build_model(path: Path, vocab: int, hidden: int = 256, layers: int = 4) -> None:
    import torch

    from grpo_parts.tiny import tiny_causal_lm

    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "verl"))
    from _cpu_verl import save_tiny_model

    save_tiny_model(str(path), vocab=48)  # tokenizer (the model is replaced below)
    model = tiny_causal_lm(
        "qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=2,
        dtype=torch.float32,
    )
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(path)


def long_tail_length(median: int, first: bool, g: Any) -> int:
    """A long-tailed completion length (RL-typical: most rows finish early, a few run long):
    log-normal around ``median`` (sigma 0.6), clipped to [1, 6 x median]; the first row of every
    other group runs 4-6 x the median, so every batch's longest completion is >= 4 x its median."""
    import math

    import torch

    if first:
        return int(median * (4 + 2 * float(torch.rand(1, generator=g))))
    z = float(torch.randn(1, generator=g))
    return max(1, min(6 * median, int(median * math.exp(0.6 * z))))


def make_batch(args: argparse.Namespace) -> Any:
    """``prompts x n`` rows, groups contiguous (as verl's Prefix Grouper needs), random lengths."""
    import torch
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(args.seed + 1000 * int(os.environ.get("RANK", "0")))
    rows = []
    for i in range(args.prompts):
        prompt = torch.randint(
            4,
            args.vocab,
            (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g)),),
            generator=g,
        )
        for j in range(args.n):
            if getattr(args, "long_tail", False):
                k = long_tail_length(args.response_len, first=(j == 0 and i % 2 == 0), g=g)
            else:
                k = int(torch.randint(args.response_len // 8, args.response_len + 1, (1,), generator=g))
            rows.append((f"p{i}", prompt, torch.randint(4, args.vocab, (k,), generator=g)))
    nested = tu.nested_tensor_from_tensor_list
    resp = [r for _, _, r in rows]
    data = tu.get_tensordict(
        {
            "input_ids": nested([torch.cat([p, r]) for _, p, r in rows]),
            "position_ids": nested([torch.arange(len(p) + len(r)) for _, p, r in rows]),
            "prompts": nested([p for _, p, _ in rows]),
            "responses": nested(resp),
            "response_mask": nested([torch.ones_like(r) for r in resp]),
            "loss_mask": nested([torch.ones_like(r) for r in resp]),
            "old_log_probs": nested([-torch.rand(len(r), generator=g) - 2.0 for r in resp]),
            "advantages": nested([torch.randn(len(r), generator=g) for r in resp]),
            "uid": [u for u, _, _ in rows],
        },
        non_tensor_dict={
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": args.n,
            "use_fused_kernels": False,
            "temperature": 1.0,
            "calculate_entropy": False,
            "global_batch_size": len(rows),
        },
    )
    return data


def pg_forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
    """verl's Prefix Grouper forward on a nested micro-batch, log-probs back in verl's layout."""
    import torch
    from verl.trainer.ppo.prefix_grouper_utils import forward_micro_batch_with_prefix_grouper
    from verl.utils.device import get_device_id, get_device_name
    from verl.workers.engine.utils import detach_tree

    micro_batch = micro_batch.to(get_device_id())
    ids, cu = micro_batch["input_ids"].values(), micro_batch["input_ids"].offsets()
    prompts = list(micro_batch["prompts"].unbind())
    p_max = max(len(p) for p in prompts)
    left = torch.stack([torch.cat([p.new_zeros(p_max - len(p)), p]) for p in prompts])  # left-padded
    mb = {
        "prompts": left,
        "responses": torch.nested.to_padded_tensor(micro_batch["responses"], 0),
        "response_mask": torch.nested.to_padded_tensor(micro_batch["response_mask"], 0),
        "uid": list(micro_batch["uid"]),
        "pad_token_id": 0,
    }
    dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
    _, lp = forward_micro_batch_with_prefix_grouper(mb, self.module, 1.0, False, get_device_name(), dtype)
    resp_lens = micro_batch["responses"].offsets().diff()
    starts = cu[:-1] + cu.diff() - resp_lens - 1
    pos = torch.cat(
        [s + torch.arange(int(n), device=ids.device) for s, n in zip(starts.tolist(), resp_lens.tolist())]
    )
    valid = torch.arange(lp.shape[1], device=ids.device)[None, :] < resp_lens[:, None]
    flat = lp.new_zeros(ids.numel()).index_put((pos,), lp[valid])
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(flat, cu)}
    if loss_function is None:
        loss, metrics = torch.tensor(1.0, device=ids.device), {}
    else:
        loss, metrics = loss_function(model_output=out, data=micro_batch, dp_group=None)
    return loss, {"model_output": detach_tree(out), "loss": loss.detach().item(), "metrics": metrics}


def token_stats(args: argparse.Namespace, variant: str) -> dict[str, int]:
    """Tokens the model runs on and logit rows computed in one update (exact, from the batch):
    verl's padded forward pads each micro-batch's rows to the longest; its packed forward runs the
    packed tokens; both compute a logit row per token. Ours runs the grouped layout and computes logit
    rows for completion positions only (padded to the longest completion of the call)."""
    from grpo_parts_adapters.verl.attention import packed_call

    from grpo_parts.attention.shared_prefix import SharedPrefixAttention
    from grpo_parts.tiny import tiny_causal_lm

    # the plan reads the model's sizes (score weights) only; a tiny one of the same vocabulary serves
    model = tiny_causal_lm("llama", vocab_size=args.vocab, hidden_size=16, num_layers=1, num_heads=2)
    one_call = variant == "ours_one_call"
    backend = SharedPrefixAttention(
        layout=getattr(args, "layout", "auto"), max_chunks=1 if one_call else None
    )
    data = make_batch(args)
    ids, cu = data["input_ids"].values(), data["input_ids"].offsets()
    resp = data["responses"].offsets().diff()
    uids = list(data["uid"])
    tokens = logits = 0
    for s in range(0, len(uids), args.n):  # fixed micro-batches of n rows (one group each)
        rows = slice(s, s + args.n)
        lens = cu.diff()[rows]
        if variant == "verl_padded":
            tokens += int(lens.max()) * len(lens)
            logits += int(lens.max()) * len(lens)
        elif variant == "verl_packed":
            tokens += int(lens.sum())
            logits += int(lens.sum())
        elif variant == "verl_pg":
            row = int((lens - resp[rows]).max()) + int(resp[rows].sum())  # one row: prefix + all suffixes
            tokens += row
            logits += row
        else:
            sub_ids = ids[int(cu[s]) : int(cu[min(s + args.n, len(uids))])]
            sub_cu = cu[s : s + args.n + 1] - cu[s]
            call = packed_call(sub_ids, sub_cu, resp[rows], uids[rows])
            assert call is not None
            plan = backend.plan(model, call.batch, packed=True)
            tokens += int(plan.tokens)
            clen = call.batch.completion_mask.sum(-1)
            if plan.layout == "padding_free":  # a logit per response token
                logits += int(resp[rows].sum()) - len(plan.calls[0]) + len(set(uids[rows]))
            else:
                logits += sum(len(c) * int(clen[c].max()) for c in plan.calls)
    return {"model_tokens": tokens, "logit_rows": logits}


def tokens_table(args: argparse.Namespace) -> int:
    """Exact model tokens of one update on long-tailed batches (``--tokens-only``): verl's packed
    forward, a padding-free shared layout (each prompt once per group plus every completion: what
    verl's Prefix Grouper runs) and ours; ``ideal`` = packed / padding-free, ``got`` = packed / ours,
    ``share`` = got / ideal (the target is >= 0.8 where P >= S)."""
    import copy
    import statistics

    import torch

    print("| G | P (max) | median S | max S | verl packed | padding-free | ours | ideal | got | share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in (8, 16):
        for plen in (64, 256, 1024):
            for median in (48, 128):
                a = copy.copy(args)
                a.n, a.prompt_len, a.response_len, a.long_tail = n, plen, median, True
                data = make_batch(a)
                resp = data["responses"].offsets().diff()
                t = {v: token_stats(a, v)["model_tokens"] for v in ("verl_packed", "verl_pg", "ours")}
                ideal, got = t["verl_packed"] / t["verl_pg"], t["verl_packed"] / t["ours"]
                row = {"G": n, "P": plen, "median_S": statistics.median(resp.tolist()),
                       "max_S": int(resp.max()), **t, "ideal": ideal, "got": got, "share": got / ideal}  # fmt: skip
                rows.append(row)
                print(
                    f"| {n} | {plen} | {row['median_S']:.0f} | {row['max_S']} | {t['verl_packed']} | "
                    f"{t['verl_pg']} | {t['ours']} | {ideal:.2f}x | {got:.2f}x | {got / ideal:.2f} |"
                )
    del torch
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tokens": rows}))
    return 0


def build_engine(args: argparse.Namespace, variant: str) -> tuple[Any, Any, bool]:
    """verl's engine for ``variant``: ``(engine, loss_fn, use_remove_padding)``."""
    from types import MethodType

    from grpo_parts_adapters.verl.config import FSDPActorConfig
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    grpo_parts = {
        "attention": "shared_prefix",
        "max_chunks": 1 if variant == "ours_one_call" else None,
        "layout": getattr(args, "layout", "auto"),
    }
    mp = {"param_dtype": args.dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    cfg = FSDPActorConfig(
        strategy=args.strategy,
        rollout_n=args.n,
        ppo_mini_batch_size=args.prompts,
        ppo_micro_batch_size_per_gpu=args.n,
        fsdp_config=FSDPEngineConfig(strategy=args.strategy, mixed_precision=mp, use_torch_compile=False),
        optim=FSDPOptimizerConfig(lr=1e-5, total_training_steps=100),
        grpo_parts=grpo_parts if variant.startswith("ours") else {},
    )
    rmpad = variant == "verl_packed"
    model = HFModelConfig(
        path=str(args.model), override_config={"attn_implementation": args.attn}, use_remove_padding=rmpad
    )
    engine = FSDPEngineWithLMHead(model, cfg.engine, cfg.optim, CheckpointConfig())
    engine.initialize()
    if variant == "verl_pg":
        from verl.models.transformers.monkey_patch import apply_prefix_grouper_patch

        apply_prefix_grouper_patch()
        engine.forward_step = MethodType(pg_forward_step, engine)  # type: ignore[method-assign]
    return engine, partial(ppo_loss, config=cfg), rmpad


def _data(args: argparse.Namespace, rmpad: bool) -> Any:
    from verl.utils import tensordict_utils as tu

    d = make_batch(args)
    tu.assign_non_tensor(d, use_remove_padding=rmpad)
    return d


def _update(engine: Any, loss_fn: Any, data: Any) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with engine.train_mode():
        engine.train_batch(data, loss_fn)
    sync()
    return time.perf_counter() - t0


def run_time(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant's engine from the same weights in one process; updates interleaved round-robin
    (fair under a varying machine load); log-probs of the first batch vs ``verl_padded``."""
    import torch
    from verl.workers.utils.padding import no_padding_2_padding

    engines = {v: build_engine(args, v) for v in args.variants}
    out: dict[str, Any] = {}
    ref = None
    for v, (engine, _, rmpad) in engines.items():
        with engine.eval_mode():
            lp = no_padding_2_padding(
                engine.infer_batch(_data(args, rmpad))["model_output"]["log_probs"], _data(args, rmpad)
            )
        mask = torch.nested.to_padded_tensor(_data(args, rmpad)["response_mask"], 0).bool()
        ref = lp[mask].float() if ref is None else ref
        out[v] = {"max_abs_logprob_diff": float((lp[mask].float() - ref).abs().max()), "update_s": []}
    for i in range(args.repeats + 1):  # round 0 is warm-up
        for v, (engine, loss_fn, rmpad) in engines.items():
            t = _update(engine, loss_fn, _data(args, rmpad))
            if i:
                out[v]["update_s"].append(t)
    for v, r in out.items():
        r["update_s_median"] = statistics.median(r["update_s"])
        r["update_s_min"] = min(r["update_s"])
        r.update(token_stats(args, v))
        r["padding_free_tokens"] = token_stats(args, "verl_pg")["model_tokens"]
    resp = make_batch(args)["responses"].offsets().diff().tolist()
    out["shape"] = {"median_S": statistics.median(resp), "max_S": max(resp)}
    return out


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: peak memory of an update (after a warm-up update)."""
    import torch

    engine, loss_fn, rmpad = build_engine(args, args.variant)
    _update(engine, loss_fn, _data(args, rmpad))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _update(engine, loss_fn, _data(args, rmpad))
        return {
            "peak_increase_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
            "what": "CUDA allocated",
        }
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _update(engine, loss_fn, _data(args, rmpad))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_increase_mib": (peak - base) / 1024, "what": "RSS high-water mark"}


def _environment(args: argparse.Namespace) -> Any:
    """verl's device helpers on CPU (no accelerator), else a one-rank NCCL group on this GPU."""
    import contextlib

    import torch

    if not torch.cuda.is_available():
        from _cpu_verl import verl_on_cpu

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of --ranks N: its gloo group first
            import torch.distributed as dist

            dist.init_process_group("gloo")
        return verl_on_cpu()

    @contextlib.contextmanager
    def gpu() -> Any:
        import torch.distributed as dist

        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:29581", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()

    return gpu()


def _spawn(cmd: list[str], ranks: int) -> dict[str, Any]:
    """``cmd`` on ``ranks`` processes (a gloo group; one thread each when several); rank 0's JSON."""
    from multirank import free_port

    env = dict(os.environ)
    procs = []
    for r in range(ranks):
        e = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks)}
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port() if r == 0 else e.get("MASTER_PORT")))
        env["MASTER_PORT"] = e["MASTER_PORT"]
        out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, env=e, stdout=out, stderr=subprocess.PIPE, text=True))
    first, err = procs[0].communicate()
    for p in procs[1:]:
        p.wait()
    if procs[0].returncode:
        return {"error": (err.strip().splitlines() or ["?"])[-1]}
    return json.loads(first.strip().splitlines()[-1])  # type: ignore[no-any-return]


def sweep(args: argparse.Namespace) -> int:
    """``--sweep``: update time, model tokens and logit rows of verl's padded and packed forwards and
    ours on long-tailed batches, over G x P x median completion (``--sweep-*``), on ``--ranks``
    gloo processes (each rank its own batch); one markdown row per point, then JSON."""
    build_model(args.model, args.vocab, args.hidden, args.layers)
    variants = ["verl_padded", "verl_packed", "ours"]
    print("| ranks | G | P (max) | median S | max S | update s: verl padded / packed / ours | ours vs "
          "faster verl | model tokens: padded / packed / ours (padding-free) | logit rows: packed / ours "
          "| share of ideal | max abs log-prob diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in args.sweep_g:
        for plen in args.sweep_p:
            for median in args.sweep_median:
                a = [sys.executable, __file__, "--mode", "time", "--long-tail", "--model", str(args.model)]
                a += ["--prompts", str(args.prompts), "--n", str(n), "--prompt-len", str(plen)]
                a += [
                    "--response-len",
                    str(median),
                    "--vocab",
                    str(args.vocab),
                    "--repeats",
                    str(args.repeats),
                ]
                a += ["--threads", str(max(1, args.threads // args.ranks)), "--layout", args.layout]
                a += ["--variants", *variants]
                r = _spawn(a, args.ranks)
                if "error" in r:
                    print(
                        f"| {args.ranks} | {n} | {plen} | {median} | | error: {r['error'][:160]} | | | | | |"
                    )
                    continue
                t = {v: r[v]["update_s_median"] for v in variants}
                tok = {v: r[v]["model_tokens"] for v in variants}
                faster = min(t["verl_padded"], t["verl_packed"])
                free = r["ours"]["padding_free_tokens"]
                share = (tok["verl_packed"] / tok["ours"]) / (tok["verl_packed"] / free)
                row = {"ranks": args.ranks, "G": n, "P": plen, **r["shape"], "update_s": t, "model_tokens": tok,
                       "logit_rows": {v: r[v]["logit_rows"] for v in variants}, "padding_free_tokens": free,
                       "ours_over_faster_verl": t["ours"] / faster, "share_of_ideal": share}  # fmt: skip
                rows.append(row)
                print(
                    f"| {args.ranks} | {n} | {plen} | {r['shape']['median_S']:.0f} | {r['shape']['max_S']} | "
                    f"{t['verl_padded']:.2f} / {t['verl_packed']:.2f} / {t['ours']:.2f} | {t['ours'] / faster:.2f} | "
                    f"{tok['verl_padded']} / {tok['verl_packed']} / {tok['ours']} ({free}) | "
                    f"{row['logit_rows']['verl_packed']} / {row['logit_rows']['ours']} | {share:.2f} | "
                    f"{r['ours']['max_abs_logprob_diff']:.1e} |",
                    flush=True,
                )
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "sweep": rows}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--mode",
        choices=["all", "time", "memory"],
        default="all",
        help="all: time and memory, each in subprocesses (default); time / memory: one measurement, JSON out",
    )
    p.add_argument("--variant", choices=VARIANTS, default=None, help="memory mode: the variant")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=None,
        help="default: all but ours_one_call (verl_pg needs flash-attn)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=Path("/tmp/grpo_parts_verl_bench/model"),
        help="model folder, (re)built there (default: /tmp/grpo_parts_verl_bench/model)",
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per batch (default: 4)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (= micro-batch: one group each)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=256,
        help="longest prompt; each is drawn in [len/2, len] (default: 256)",
    )
    p.add_argument("--response-len", type=int, default=128, help="longest completion (--long-tail: median)")
    p.add_argument(
        "--long-tail", action="store_true", help="long-tailed completion lengths (see long_tail_length)"
    )
    p.add_argument(
        "--tokens-only",
        action="store_true",
        help="print the exact model-token table over G in {8, 16}, P in {64, 256, 1024}, median completion in "
        "{48, 128} (long-tailed) and exit: no engine, no timing",
    )
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary size (default: 8192)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed updates per variant after one warm-up (default: 5)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument(
        "--strategy", choices=["fsdp", "fsdp2"], default=None, help="default: fsdp on GPU, fsdp2 on CPU"
    )
    p.add_argument("--attn", default=None, help="default: flash_attention_2 on GPU, sdpa on CPU")
    p.add_argument("--dtype", default=None, help="param dtype, default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch (default: 0)")
    p.add_argument("--layout", default="auto", help="the shared-prefix layout (auto, grid, padding_free)")
    p.add_argument("--sweep", action="store_true", help="long-tailed sweep (see sweep()); --model is rebuilt")
    p.add_argument("--ranks", type=int, default=1, help="--sweep: gloo processes (each its own batch)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (--sweep)")
    p.add_argument("--layers", type=int, default=4, help="model layers (--sweep)")
    p.add_argument(
        "--sweep-g", type=int, nargs="+", default=[8, 16], help="--sweep: group sizes (default: 8 16)"
    )
    p.add_argument(
        "--sweep-p",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="--sweep: prompt lengths (default: 64 256 1024)",
    )
    p.add_argument(
        "--sweep-median",
        type=int,
        nargs="+",
        default=[48, 128],
        help="--sweep: median completion lengths (default: 48 128)",
    )
    args = p.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    args.strategy = args.strategy or ("fsdp" if gpu else "fsdp2")
    args.attn = args.attn or ("flash_attention_2" if gpu else "sdpa")
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    # verl's Prefix Grouper needs flash-attn: its attention masks are 2-D padding masks and the
    # suffix pass relies on flash-attn's bottom-right causal alignment (SDPA/eager fail)
    default = [
        v for v in VARIANTS if (v != "verl_pg" or args.attn.startswith("flash")) and v != "ours_one_call"
    ]
    args.variants = args.variants or default
    if args.tokens_only:
        sys.path.insert(0, str(ROOT / "tests" / "adapters" / "verl"))
        return tokens_table(args)
    sys.path.insert(0, str(ROOT / "tests"))  # multirank.free_port
    if args.sweep:
        return sweep(args)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "verl"))
    if args.mode != "all":
        with _environment(args):
            print(json.dumps(run_time(args) if args.mode == "time" else run_memory(args)))
        return 0
    build_model(args.model, args.vocab)
    keys = ("model", "prompts", "n", "prompt_len", "response_len", "vocab", "repeats", "threads", "strategy")
    forward = [
        x
        for k in (*keys, "attn", "dtype", "seed")
        for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))
    ] + (["--long-tail"] if args.long_tail else [])
    results: dict[str, Any] = {}

    def sub(*extra: str) -> dict[str, Any]:
        cmd = [sys.executable, __file__, *forward, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if r.returncode:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
        return json.loads(r.stdout.strip().splitlines()[-1])

    timing = sub("--mode", "time", "--variants", *args.variants)
    for v in args.variants:
        results[v] = {**timing.get(v, timing), **sub("--mode", "memory", "--variant", v)}
    print(
        "| variant | update s (min / median) | model tokens | logit rows | peak memory increase (MiB) "
        "| max abs log-prob diff vs first |"
    )
    print("|---|---|---|---|---|---|")
    for v, r in results.items():
        if "error" in r:
            print(f"| {v} | error: {r['error'][:120]} | | | | |")
        else:
            print(
                f"| {v} | {r['update_s_min']:.1f} / {r['update_s_median']:.1f} | {r['model_tokens']} | "
                f"{r['logit_rows']} | {r['peak_increase_mib']:.0f} | {r['max_abs_logprob_diff']:.1e} |"
            )
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
