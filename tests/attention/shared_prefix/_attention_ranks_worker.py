"""One rank of test_chunking_ranks.py: ``python _attention_ranks_worker.py OUT_DIR`` under multirank.run_ranks.

A float64 tiny Qwen2 sharded with FSDP2 (``fully_shard`` per decoder layer and at the root) over a
two-rank gloo group; the ranks hold batches of different shapes (rank 0 a single group, or three;
rank 1 five groups with long-tailed completions). For each case the shared-prefix backend (default
``max_chunks``) and the repeated-prefix reference compute log-probs, entropies and a GRPO-style loss's
gradients (FSDP-reduced over both ranks); the worker saves the largest differences and the plans.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _attention_helpers import exact_norms  # noqa: E402

from grpo_parts.attention import LogprobBatch  # noqa: E402
from grpo_parts.attention.reference import RepeatedPrefixAttention  # noqa: E402
from grpo_parts.attention.shared_prefix.backend import SharedPrefixAttention  # noqa: E402
from grpo_parts.tiny import tiny_causal_lm  # noqa: E402


def make_batch(groups: list[tuple[int, list[int]]], seed: int) -> LogprobBatch:
    """``groups``: (prompt length, completion lengths of its rows)."""
    g = torch.Generator().manual_seed(seed)
    p, t = max(pl for pl, _ in groups), max(max(ls) for _, ls in groups)
    rows = []
    for gi, (pl, lens) in enumerate(groups):
        prompt = torch.randint(1, 32, (pl,), generator=g)
        for n in lens:
            rows.append((gi, prompt, torch.randint(1, 32, (n,), generator=g)))
    order = torch.randperm(len(rows), generator=g).tolist()  # rows in any order
    rows = [rows[i] for i in order]
    pid, pm = torch.zeros(len(rows), p, dtype=torch.long), torch.zeros(len(rows), p, dtype=torch.long)
    cid, cm = torch.zeros(len(rows), t, dtype=torch.long), torch.zeros(len(rows), t, dtype=torch.long)
    for r, (_, prompt, comp) in enumerate(rows):
        pid[r, p - len(prompt) :], pm[r, p - len(prompt) :] = prompt, 1
        cid[r, : len(comp)], cm[r, : len(comp)] = comp, 1
    return LogprobBatch(pid, pm, cid, cm, torch.tensor([gi for gi, _, _ in rows]))


#: case -> (backend options, rank 0's groups, rank 1's groups)
CASES: dict[str, tuple[dict[str, Any], list, list]] = {
    "single_group_vs_split": (
        {"chunk_overhead_tokens": -1, "layout": "grid"},
        [(5, [3, 6])],
        [(4, [2]), (6, [2, 3, 1]), (3, [12]), (7, [5, 5]), (2, [1, 9, 4, 2])],
    ),
    "replan_and_pad": (
        {"chunk_overhead_tokens": 2, "layout": "grid"},
        [(3, [1, 2]), (8, [7]), (4, [2, 2, 2])],
        [(4, [2, 1, 1]), (6, [30, 1]), (3, [1, 2]), (7, [2, 2]), (2, [14, 1, 1])],
    ),
    "default_options": ({}, [(5, [4])], [(6, [3, 2]), (4, [1])]),
    # rank 0: one long-tailed group, padding-free (one call); rank 1: groups of equal completions,
    # grid split into three calls (ties keep the grid): rank 0 pads with two empty calls
    "padding_free_vs_grid": (
        {"chunk_overhead_tokens": -1},
        [(5, [1, 1, 1, 12])],
        [(4, [3, 3]), (6, [2, 2]), (3, [5])],
    ),
}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        p.grad = None
    return out


def run_case(model: torch.nn.Module, name: str, rank: int) -> dict[str, Any]:
    options, g0, g1 = CASES[name]
    batch = make_batch(g0 if rank == 0 else g1, seed=10 * rank + len(name))
    adv = torch.linspace(-1, 1, batch.completion_ids.shape[0], dtype=torch.float64)[:, None]
    res: dict[str, Any] = {}
    outs = {}
    for label, backend in {
        "shared": SharedPrefixAttention(**options),
        "ref": RepeatedPrefixAttention(),
    }.items():
        with torch.no_grad():  # the old-policy pass
            nograd = backend.completion_logprobs(model, batch, temperature=0.7).logprobs
        out = backend.completion_logprobs(model, batch, temperature=0.7, compute_entropy=True)
        loss = (out.logprobs * adv).sum() + 0.1 * out.entropies.sum()
        loss.backward()
        outs[label] = (nograd, out.logprobs.detach(), out.entropies.detach(), grads(model))
        if label == "shared":
            res["plan"] = dict(backend.last_plan)
    (a0, a1, a2, ga), (b0, b1, b2, gb) = outs["shared"], outs["ref"]
    res["logprob_diff"] = max(float((a0 - b0).abs().max()), float((a1 - b1).abs().max()))
    res["entropy_diff"] = float((a2 - b2).abs().max())
    res["grad_diff"] = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    res["grad_norm"] = max(float(v.abs().max()) for v in gb.values())
    return res


def start_rank() -> tuple[int, int]:
    """Join the gloo group ``multirank.run_ranks`` set up (its environment), one torch thread per
    rank; ``(rank, world size)``."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def finish_rank(results: dict[str, Any], out: Path) -> None:
    """Save this rank's results where ``multirank.run_ranks`` reads them, once every rank got here."""
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = Path(sys.argv[1])
    rank, _ = start_rank()
    model = exact_norms(tiny_causal_lm("qwen2", vocab_size=32, num_kv_heads=2, dtype=torch.float64, seed=0))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    finish_rank({name: run_case(model, name, rank) for name in CASES}, out)


if __name__ == "__main__":
    main()
