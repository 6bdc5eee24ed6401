"""CPPO / zero-variance / refill with two data-parallel ranks in verl (TransferQueue on Ray local,
then verl's actor TrainingWorker with the FSDP2 engine on two gloo processes, CPU).

verl filters in its single controller: the custom sampler (``FilteringReplayBuffer``) runs once on
the global batch in the trainer process. Here that controller is verl's own code on a real
TransferQueue: ``PPOTrainer._build_replay_buffer`` / ``sample`` (filter, rounding, refill),
``_balance_batch``, ``_compute_advantage`` (``grpo_parts_grpo``), ``_update_actor`` (the extra info
the actor gets), then verl's dispatch (``dispatch_lazy_compute_data_proto``, which cuts the
``KVBatchMeta`` into one chunk per data-parallel rank -- unequal when the count does not split) and
verl's ``tqbridge`` fetch of each chunk (``_meta_to_realdata``). Each rank then runs verl's
``TrainingWorker.train_mini_batch`` on its chunk (``_verl_filter_ranks_worker.py``): a mini-batch
iterator, token counts all-gathered, one FSDP2 optimizer step per mini-batch; ranks with different
numbers of mini-batches or micro-batches would hang, and a hard timeout fails the test.

Composed by hand, because no Ray actor can hold a gloo group with CPU FSDP here: the trainer is a
stub holding verl's config (``test_sampler_tq.trainer_stub``); the worker group is verl's
``WorkerGroup`` with the dispatch table of two ranks and no actors; the fetched chunks travel to
the rank processes as a file instead of a Ray call; ``old_log_probs`` (verl's old-policy forward on
the same workers, not under test) is a constant written into TransferQueue.

Rollout: four prompts of ``n = 4``; prompts 0 and 1 have a reward signal, prompts 2 and 3 -- the
second half, rank 1's share in submission order -- none. Per case: the kept count is a multiple of
``lcm(ppo_mini_batch_size x n, ranks) = 4``, verl's balancing adds no padding row, both ranks get
equal shares of whole mini-batches (2 rows per rank per optimizer step), run the same number of
optimizer steps and micro-batches, and every kept row is trained exactly once (token ids, loss
tokens), none with a zero advantage; the filter and refill counters are > 0.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transfer_queue")
pytest.importorskip("verl.trainer.ppo.v1")
pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("ray")

import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from _verl_filter_ranks_worker import MINI_BATCH  # noqa: E402
from grpo_parts_adapters.verl import advantage  # noqa: E402
from multirank import run_ranks  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from test_sampler_tq import N, Rollouts, dp_config, store, trainer_stub  # noqa: E402,F401
from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # noqa: E402

HERE = Path(__file__).resolve().parent
RANKS = 2
STEP_ROWS = MINI_BATCH * N  # rows per optimizer step (verl's ppo_mini_batch_size x rollout.n)
#: name -> (filter, kwargs, extra sampler options)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "cppo": ("cppo", {"k": 5}, {}),  # 5 kept rows, rounded up to 8
    "zero_variance": ("zero_variance", {}, {}),  # prompts 0 and 1 only: rank 1's natural share is empty
    "refill": ("zero_variance", {}, {"target_rows": 12, "refill_rounds": 3}),  # 8 kept, refilled to 12
}


class Signal(Rollouts):
    """Prompt ``i`` has rewards ``REWARDS[i % 4]``: a signal in prompts 0 and 1 of each four."""

    REWARDS = ([1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0], [0.0] * N, [1.0] * N)


def worker_group() -> Any:
    """verl's WorkerGroup as the dispatch functions see it: two actor ranks, no Ray actors."""
    from verl.single_controller.base.worker_group import WorkerGroup

    wg = object.__new__(WorkerGroup)
    wg._workers, wg._dispatch_info, wg._collect_info = [None] * RANKS, {"actor": list(range(RANKS))}, {}
    return wg


def fetch(meta: Any) -> Any:
    """What verl's ``tqbridge`` does with a rank's chunk before the worker method runs."""
    from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta

    if isinstance(meta, tq.KVBatchMeta):
        meta = kv_batch_meta2batch_meta(meta)
    return _meta_to_realdata(meta)


def controller(name: str) -> dict[str, Any]:
    """verl's trainer steps from sampling to the actor update, for one case; returns each rank's
    fetched share and what the controller decided."""
    from verl.single_controller.base.decorator import dispatch_lazy_compute_data_proto

    filt, kwargs, options = CASES[name]
    extra = [f"+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.{k}={v}" for k, v in options.items()]
    cfg = dp_config(*extra, name=filt, kwargs=kwargs)
    rollout = Signal(name.replace("_", "") + "-")  # verl cuts keys at "_" to find the uid
    stub = trainer_stub(cfg, rollout)
    wg = stub.actor_rollout_wg = worker_group()
    updates: list[Any] = []

    def update_actor(batch: Any) -> dict[str, Any]:  # the Ray call to the actor ranks
        updates.append(batch)
        return {"metrics": {"mfu": 0.0}}

    wg.update_actor = update_actor
    buffer = PPOTrainer._build_replay_buffer(stub)
    rollout.submit(cfg.data.train_batch_size)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=cfg.data.train_batch_size)
    batch = PPOTrainer._balance_batch(stub, batch, metrics)
    mask = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["response_mask"])
    old = [torch.full((int(m.numel()),), -1.5) for m in mask["response_mask"].unbind()]
    fields = TensorDict(
        {"old_log_probs": torch.nested.as_nested_tensor(old, layout=torch.jagged)}, [len(old)]
    )
    tq.kv_batch_put(keys=batch.keys, partition_id="train", fields=fields)
    batch = PPOTrainer._compute_advantage(stub, batch, metrics)
    PPOTrainer._update_actor(stub, batch, metrics)
    (chunks,), _ = dispatch_lazy_compute_data_proto("actor", wg, updates[0])
    shares = [fetch(c) for c in ray.get(list(chunks))]
    return {
        "shares": shares,
        "kept": [tuple(t.tolist()) for s in shares for t in s["input_ids"].unbind()],
        "padding": sum(t.get("is_padding", False) for t in batch.tags),
        "metrics": metrics,
        "refill_calls": rollout.calls[1:],
    }


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    request.getfixturevalue("store")  # Ray local + TransferQueue (test_sampler_tq)
    out = tmp_path_factory.mktemp("verl_filter_ranks")
    decided = {name: controller(name) for name in CASES}
    assert not advantage._FULL_GROUPS  # every kept group's full-group advantages were consumed
    torch.save({name: d.pop("shares") for name, d in decided.items()}, out / "shares.pt")
    ranks = run_ranks(HERE / "_verl_filter_ranks_worker.py", out, world=RANKS, timeout=240)
    for r in ranks:
        assert not r["errors"], r["errors"]
    return decided, [r["cases"] for r in ranks]


@pytest.mark.parametrize("name", list(CASES))
def test_kept_rows_balanced_whole_steps_all_trained(runs, name):  # type: ignore[no-untyped-def]
    decided, ranks = runs
    case = decided[name]
    runs_ = [r[(name,)] for r in ranks]
    n = len(case["kept"])
    assert n > 0 and n % STEP_ROWS == 0 and n % RANKS == 0 and case["padding"] == 0
    assert case["metrics"]["parts/filter/rows_kept"] == n
    assert case["metrics"]["parts/filter/rows_generated"] > n  # the filter dropped rows
    trained: Counter = Counter()
    for run in runs_:
        assert run["share_rows"] == n // RANKS  # equal shares ...
        assert run["mini_batches"] == [STEP_ROWS // RANKS] * (n // STEP_ROWS)  # ... of whole steps
        assert len(run["micro_batches"]) == len(runs_[0]["micro_batches"]) > 0
        assert all(m["loss_tokens"] > 0 and m["min_abs_adv"] > 0 for m in run["micro_batches"])
        assert len(run["grad_norms"]) == n // STEP_ROWS
        trained.update(row for m in run["micro_batches"] for row in m["rows"])
    assert trained == Counter(case["kept"])  # every kept row trained once, nothing else


def test_the_cases_round_refill_and_empty_a_natural_share(runs):  # type: ignore[no-untyped-def]
    decided, _ = runs
    assert len(decided["cppo"]["kept"]) == 8  # CPPO kept 5, rounded up to whole steps
    zv = decided["zero_variance"]
    assert len(zv["kept"]) == 8 and zv["metrics"]["parts/filter/rows_generated"] == 16
    refill = decided["refill"]
    assert len(refill["kept"]) == 12 and refill["refill_calls"]
    assert refill["metrics"]["parts/filter/rows_generated"] > 16
