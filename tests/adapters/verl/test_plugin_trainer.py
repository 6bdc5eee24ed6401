"""verl adapter: loading through verl's own plugin mechanisms, and the ``grpo_parts_sync`` trainer's
filter + refill on TransferQueue batches (against an in-memory stand-in store)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transfer_queue")
pytest.importorskip("verl.trainer.ppo.v1")

from grpo_parts_adapters.verl import PLUGIN_MODULE  # noqa: E402
from grpo_parts_adapters.verl import kv_filter as kv  # noqa: E402
from grpo_parts_adapters.verl import trainer as tr  # noqa: E402
from grpo_parts_adapters.verl.filtering import FilterOptions  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402


def _registered() -> dict[str, bool]:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1 import get_trainer_cls

    return {
        "adv": "grpo_parts_grpo" in ADV_ESTIMATOR_REGISTRY,
        "trainer": get_trainer_cls("grpo_parts_sync") is tr.GrpoPartsSyncTrainer,
        "agent": "grpo_parts_agent" in _agent_loop_registry,
    }


def test_external_lib_registers_every_part():
    import_external_libs(PLUGIN_MODULE)  # what actor_rollout_ref.model.external_lib does
    from grpo_parts_adapters.verl import plugin

    assert plugin.STATUS["advantage_estimator"] == plugin.STATUS["trainer"] == "registered"
    assert plugin.STATUS["agent_loop"] == plugin.STATUS["attention_config"] == "registered"
    assert all(_registered().values())


def test_entry_point_registers_on_import_verl_in_a_fresh_process():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="verl.plugins")}
    if eps.get("grpo_parts") != PLUGIN_MODULE:
        pytest.skip("package not installed with `pip install -e .` (no verl.plugins entry point)")
    code = (
        "import verl, sys\n"
        "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as A\n"
        "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY as T\n"
        "sys.exit(0 if 'grpo_parts_grpo' in A and 'grpo_parts_sync' in T else 3)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


class FakeStore:
    """In-memory stand-in for TransferQueue's kv API (kv_batch_get / kv_clear)."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def put(self, key, uid, reward, length, width=4):
        mask = torch.zeros(width, dtype=torch.long)
        mask[:length] = 1
        scores = torch.zeros(width)
        scores[length - 1] = reward
        self.rows[key] = {"uid": uid, "rm_scores": scores, "response_mask": mask}

    def kv_batch_get(self, keys, partition_id, select_fields):
        rows = [self.rows[k] for k in keys]
        td = TensorDict(
            {f: torch.stack([r[f] for r in rows]) for f in select_fields if f != "uid"},
            batch_size=[len(keys)],
        )
        td["uid"] = [r["uid"] for r in rows]
        return td

    def kv_batch_put(self, keys, partition_id, fields, tags=None):
        for i, k in enumerate(keys):
            for f in fields.keys():
                self.rows[k][f] = fields[f][i]

    def kv_clear(self, keys, partition_id):
        for k in keys:
            del self.rows[k]


def _batch(store, prompt_rewards: dict[str, list[float]]):
    keys, tags = [], []
    for uid, rewards in prompt_rewards.items():
        for j, r in enumerate(rewards):
            key = f"{uid}_0_{j}"
            store.put(key, uid, r, length=1 + j % 3)
            keys.append(key)
            tags.append({"uid": uid, "seq_len": 5})
    return KVBatchMeta(partition_id="train", keys=keys, tags=tags, extra_info={"temperature": 1.0})


def test_filter_kv_batch_keeps_top_k_and_clears_the_rest():
    store = FakeStore()
    batch = _batch(store, {"a": [1, 0, 0, 0], "b": [1, 1, 1, 1], "c": [0.0, 1.0, 0.5, 1.0]})
    opts = FilterOptions(name="cppo", kwargs={"k": 3})
    kept, metrics = kv.filter_kv_batch(batch, opts.build(), opts, store=store)
    # group a: A = (1-.25)/.5 = 1.5 for row 0, -0.5 others; group b zero variance; group c |A| ~ 1.31, 0.87
    # ties (c_0_1, c_0_3 at 0.78) break towards the lower row
    assert kept.keys == ["a_0_0", "c_0_0", "c_0_1"]
    assert set(store.rows) == set(kept.keys)  # pruned rows cleared from TransferQueue
    assert [t["uid"] for t in kept.tags] == [k.split("_")[0] for k in kept.keys]
    assert kept.partition_id == "train" and kept.extra_info == {"temperature": 1.0}
    assert metrics["parts/filter/rows_kept"] == 3
    # every rolled-out row's mean reward (verl's own critic/score sees only the kept rows)
    assert metrics["parts/filter/score_mean_rolled_out"] == pytest.approx((1 + 4 + 2.5) / 12)
    # the full-group advantages of the kept rows travel with them ...
    seq = torch.stack([store.rows[k][kv.SEQ_ADV_FIELD] for k in kept.keys])
    c = torch.tensor([0.0, 1.0, 0.5, 1.0])
    expect = torch.tensor(
        [1.5, float((c[0] - c.mean()) / (c.std() + 1e-6)), float((c[1] - c.mean()) / (c.std() + 1e-6))]
    )
    torch.testing.assert_close(seq, expect, rtol=1e-5, atol=1e-6)
    # ... and replace what verl's estimator computes on the kept rows alone (here: a singleton group a)
    kv.restore_group_advantages(kept, store=store)
    for k, a in zip(kept.keys, seq):
        row = store.rows[k]
        torch.testing.assert_close(row["advantages"], a * row["response_mask"].float())
        torch.testing.assert_close(row["returns"], row["advantages"])


def test_filter_kv_batch_refills_until_target():
    store = FakeStore()
    batch = _batch(store, {"a": [1, 1], "b": [0, 1]})  # only b has signal: 2 rows
    calls = []

    def more(n_prompts):
        calls.append(n_prompts)
        i = len(calls)
        return _batch(store, {f"r{i}x{j}": [0, 1] for j in range(n_prompts)})

    opts = FilterOptions(name="zero_variance", target_rows=6, refill_rounds=4)
    kept, metrics = kv.filter_kv_batch(batch, opts.build(), opts, store=store, more=more)
    assert len(kept.keys) == 6 and calls  # refilled with more prompts
    assert not any(k.startswith("a_") for k in kept.keys)
    assert set(store.rows) == set(kept.keys)
    assert metrics["parts/filter/rounds"] >= 2


def test_filter_options_from_config():
    assert tr.filter_options_from(OmegaConf.create({})) is None
    cfg = OmegaConf.create({"grpo_parts": {"filter": {"name": "cppo", "kwargs": {"pruning_rate": 0.5}}}})
    assert tr.filter_options_from(cfg) == FilterOptions(name="cppo", kwargs={"pruning_rate": 0.5})
    with pytest.raises(ValueError):
        tr.filter_options_from(OmegaConf.create({"grpo_parts": {"filter": {"name": "cppo", "bogus": 1}}}))
    drgrpo = cfg.copy()
    drgrpo.algorithm = {"norm_adv_by_std_in_grpo": False}
    assert tr.filter_options_from(drgrpo).norm_adv_by_std is False
    # kept rows fill whole mini-batches on every rank: lcm(2 x 4 rows per step, 3 ranks)
    dp = cfg.copy()
    dp.actor_rollout_ref = {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": 4}}
    dp.trainer = {"n_gpus_per_node": 3, "nnodes": 1}
    assert tr.filter_options_from(dp).batch_multiple == 24


def test_trainer_refuses_algorithms_it_would_train_wrongly():
    tr.check_algorithm(OmegaConf.create({"algorithm": {"adv_estimator": "grpo_parts_grpo"}}))
    with pytest.raises(ValueError, match="adv_estimator.*got 'gae'.*use_kl_in_reward"):
        tr.check_algorithm(
            OmegaConf.create({"algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True}})
        )


def test_filtering_replay_buffer_refills_in_whole_gen_batches(monkeypatch):
    """The buffer the trainer mode puts around verl's own: filters, asks verl for more prompts in
    multiples of data.gen_batch_size (verl's own constraint), and leaves validation batches alone."""
    from grpo_parts_adapters.verl.sampler import FilteringReplayBuffer
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    store = FakeStore()
    submitted = []
    counter = iter(range(1000))

    def sample(self, global_steps, partition_id, batch_size):
        i = next(counter)
        rewards = {f"p{i}x{j}": ([0, 1] if j % 2 == 0 else [1, 1]) for j in range(batch_size)}
        return _batch(store, rewards), {"inner/calls": 1.0}

    monkeypatch.setattr(ReplayBuffer, "sample", sample)
    inner = ReplayBuffer.__new__(ReplayBuffer)
    inner.refill_fn = submitted.append
    opts = tr.filter_options_from(
        OmegaConf.create({"data": {"train_batch_size": 4, "gen_batch_size": 2},
                          "grpo_parts": {"filter": {"name": "zero_variance", "target_rows": 6, "refill_rounds": 5}}})
    )  # fmt: skip
    buf = FilteringReplayBuffer.around(inner, opts, opts.build(), None, store=store)
    kept, metrics = buf.sample(global_steps=1, partition_id="train", batch_size=4)
    assert len(kept.keys) == 6 and submitted and all(n % 2 == 0 for n in submitted)
    assert set(store.rows) == set(kept.keys) and metrics["parts/filter/rows_kept"] == 6
    val, _ = buf.sample(global_steps=1, partition_id="val", batch_size=2)
    assert len(val.keys) == 4  # untouched: 2 prompts x 2 rows
