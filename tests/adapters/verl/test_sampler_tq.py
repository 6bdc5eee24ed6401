"""verl adapter: filter + refill through verl's public custom-sampler seam, on a real TransferQueue
(Ray local, CPU), inside the v1 fit loop's batch assembly.

verl's own ``PPOTrainer._build_replay_buffer`` builds the sampler from verl's composed Hydra config
plus our override list (``trainer.v1.sampler.custom_sampler`` / ``sampler_kwargs``) and hands it the
refill function; prompts and rollouts are registered in TransferQueue as verl's trainer and v1 agent
loop do. After ``sample``, verl's own ``_balance_batch`` (padding to the mini-batch multiple) and
``_compute_advantage`` (with the ``grpo_parts_grpo`` estimator) run on the kept batch: the kept rows
carry their full-group advantages, pruned rows are gone from TransferQueue, refill asked verl's
refill function for whole ``gen_batch_size`` fetches."""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transfer_queue")
pytest.importorskip("verl.trainer.ppo.v1")
ray = pytest.importorskip("ray")

import transfer_queue as tq  # noqa: E402
from _cpu_verl import rollouts, submit_prompts  # noqa: E402
from grpo_parts_adapters.verl import advantage, plugin  # noqa: E402,F401  (registers grpo_parts_grpo)
from grpo_parts_adapters.verl.sampler import PATH, FilteringReplayBuffer  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # noqa: E402

N = 4


@pytest.fixture(scope="module")
def store():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        yield
    finally:
        tq.close()
        ray.shutdown()


def verl_config(estimator: str = "grpo_parts_grpo"):
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"algorithm.adv_estimator={estimator}",
        "data.train_batch_size=4",
        "data.gen_batch_size=2",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # x n = 8 rows: the kept batch is padded to 8s
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.v1.sampler.custom_sampler.path={PATH}",
        "trainer.v1.sampler.custom_sampler.name=FilteringReplayBuffer",
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.name=zero_variance",
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.target_rows=12",
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.refill_rounds=3",
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.refill_multiple=${data.gen_batch_size}",
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.train_batch_size=${data.train_batch_size}",
    ]
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"  # verl's default trainer
    return cfg


class Rollouts:
    """Stands in for verl's trainer + agent loop: each submitted prompt's ``n`` rollouts land in
    TransferQueue; prompt ``i`` has rewards ``REWARDS[i % len(REWARDS)]`` (here 0 and 2 have no signal)."""

    REWARDS: tuple[list[float], ...] = ([1.0] * N, [1.0, 0.0, 0.0, 1.0], [0.0] * N)

    def __init__(self, prefix: str):
        self.prefix, self.count, self.calls = prefix, 0, []

    def submit(self, n_prompts: int) -> int:  # verl's refill_fn contract: an exact number of prompts
        self.calls.append(n_prompts)
        rows, rewards = [], []
        for _ in range(n_prompts):
            rows += rollouts(1, N, seed=self.count, prefix=f"{self.prefix}{self.count}x")
            rewards += self.REWARDS[self.count % len(self.REWARDS)]
            self.count += 1
        return submit_prompts(rows, rewards)


def trainer_stub(cfg, rollout: Rollouts):
    """The state verl's PPOTrainer methods used here read."""
    wg = SimpleNamespace(_dispatch_info={"actor": [0]})
    stub = SimpleNamespace(
        config=cfg,
        trainer_mode="sync",
        _add_prompts_to_generate=rollout.submit,
        actor_rollout_wg=wg,
        use_critic=False,
        global_steps=1,
        tokenizer=SimpleNamespace(eos_token_id=1),
    )
    stub._get_required_batch_multiple = partial(PPOTrainer._get_required_batch_multiple, stub)
    return stub


def test_filter_and_refill_in_the_v1_fit_loop(store):
    cfg = verl_config()
    rollout = Rollouts("f")
    stub = trainer_stub(cfg, rollout)
    buffer = PPOTrainer._build_replay_buffer(stub)  # verl builds our sampler (custom_sampler seam)
    assert isinstance(buffer, FilteringReplayBuffer) and buffer.refill_fn == rollout.submit
    rollout.submit(cfg.data.train_batch_size)  # verl's prepare_step
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=cfg.data.train_batch_size)

    # only groups with a signal (prompt i % 3 == 1) are kept, refilled until 12 rows
    assert len(batch.keys) == 12 and all(int(k.split("x")[0][1:]) % 3 == 1 for k in batch.keys)
    assert rollout.calls[0] == 4 and all(c % cfg.data.gen_batch_size == 0 for c in rollout.calls[1:])
    assert metrics["parts/filter/rows_kept"] == 12
    listed = tq.kv_list("train").get("train", {})
    trajectories = {k for k, t in listed.items() if not t.get("is_prompt")}
    assert trajectories == set(batch.keys)  # pruned rows cleared from TransferQueue

    # verl's fit loop: balance (pads to the actor mini-batch multiple), then advantages
    batch = PPOTrainer._balance_batch(stub, batch, metrics)
    assert len(batch.keys) == 16 and sum(t.get("is_padding", False) for t in batch.tags) == 4
    batch = PPOTrainer._compute_advantage(stub, batch, metrics)
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "rm_scores"])
    r = torch.tensor(Rollouts.REWARDS[1])
    full = (r - r.mean()) / (r.std() + 1e-6)  # the advantage within the whole group
    for tag, adv, score in zip(batch.tags, data["advantages"].unbind(), data["rm_scores"].unbind()):
        if tag.get("is_padding"):
            assert torch.all(adv == 0)
        else:
            want = full[int(score.sum() == 0)]  # rewards [1, 0, 0, 1]: a 1-row or a 0-row
            torch.testing.assert_close(adv, want.expand_as(adv), rtol=0, atol=1e-6)
    assert not advantage._FULL_GROUPS  # consumed by grpo_parts_grpo


def test_verls_own_estimator_is_refused_after_the_first_step(store):
    """With verl's ``grpo`` the kept rows would be re-normalised among themselves; the sampler
    notices at the next sample that its full-group advantages were never used."""
    cfg = verl_config("grpo")
    rollout = Rollouts("g")
    stub = trainer_stub(cfg, rollout)
    buffer = PPOTrainer._build_replay_buffer(stub)
    rollout.submit(4)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    PPOTrainer._compute_advantage(stub, PPOTrainer._balance_batch(stub, batch, metrics), metrics)
    rollout.submit(4)
    with pytest.raises(ValueError, match="adv_estimator=grpo_parts_grpo"):
        buffer.sample(global_steps=2, partition_id="train", batch_size=4)
    assert not advantage._FULL_GROUPS


def dp_config(*extra: str, name: str = "cppo", kwargs: dict | None = None):
    """verl's config on two ranks with ``hydra_overrides(name, kwargs)`` (default CPPO ``k=3``; the
    sampler's data-parallel keys interpolated from verl's own)."""
    import verl
    from grpo_parts_adapters.verl.sampler import hydra_overrides
    from hydra import compose, initialize_config_dir

    overrides = [
        "data.train_batch_size=4",
        "data.gen_batch_size=2",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # x n = 4 rows per optimizer step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=2",
        *hydra_overrides(name, {"k": 3} if kwargs is None else kwargs),
        *extra,
    ]
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_kept_rows_fill_whole_mini_batches_on_two_ranks(store):
    """Two data-parallel ranks: the sampler rounds the kept rows to lcm(ranks, ppo_mini_batch_size
    x n) = 4, so verl's own ``_balance_batch`` adds no padding row and cuts equal per-rank shares of
    whole mini-batches; a ``target_rows`` that cannot be cut so is refused at construction."""
    cfg = dp_config()
    rollout = Rollouts("dp")
    stub = trainer_stub(cfg, rollout)
    stub.actor_rollout_wg._dispatch_info = {"actor": [0, 1]}
    buffer = PPOTrainer._build_replay_buffer(stub)
    assert buffer.grpo_parts_filter_options.batch_multiple == 4
    rollout.submit(4)  # prompts 0..3: only prompt 1 has a reward signal
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    # CPPO keeps 3 rows of prompt 1, rounded up to its 4 (verl alone would pad with a no-op row)
    assert len(batch.keys) == 4 and all(k.startswith("dp1x") for k in batch.keys)
    batch = PPOTrainer._balance_batch(stub, batch, metrics)
    assert len(batch.keys) == 4 and not any(t.get("is_padding", False) for t in batch.tags)
    shares = [batch.keys[:2], batch.keys[2:]]  # verl's dispatch cuts the reordered batch in order
    assert [len(s) for s in shares] == [2, 2]  # = ppo_mini_batch_size x n / ranks: one step each
    PPOTrainer._compute_advantage(stub, batch, metrics)
    assert not advantage._FULL_GROUPS

    refused = dp_config("+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.target_rows=6")
    with pytest.raises(ValueError, match="target_rows: expected a multiple of 4"):
        PPOTrainer._build_replay_buffer(trainer_stub(refused, rollout))


class SpreadRollouts(Rollouts):
    """Rewards that spread within groups, so that a weighted filter (dppo) has rows to drop."""

    REWARDS = ([1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0] * N, [1.0, 1.0, 0.0, 1.0])


DPPO_KW = {"pruning_rate": 0.5, "min_keep_prob": 0.2, "seed": 2}


def test_dppo_trains_each_kept_row_times_its_weight_over_the_rolled_out_rows(store):
    """The weighted ``dppo`` filter through the custom-sampler seam: no rounding (verl pads the draw
    with no-op rows itself), and every kept row trains on ``A x 1/p x K'/N`` -- ``K'`` the padded kept
    rows, ``N`` the rolled-out rows -- since verl divides each mini-batch by its fixed row count."""
    from grpo_parts_adapters.verl.kv_filter import SEQ_ADV_FIELD

    from grpo_parts.core import AdvantageConfig, group_advantages
    from grpo_parts.filter.dppo import DPPOFilter
    from grpo_parts.types import ScoredBatch

    cfg = dp_config("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "trainer.n_gpus_per_node=1",
                    name="dppo", kwargs=DPPO_KW)  # fmt: skip
    rollout = SpreadRollouts("w")
    stub = trainer_stub(cfg, rollout)
    buffer = PPOTrainer._build_replay_buffer(stub)
    rollout.submit(4)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    k = len(batch.keys)
    assert metrics["parts/filter/weighted_rows"] == k and 0 < k < 4 * N
    stored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=[SEQ_ADV_FIELD])
    batch = PPOTrainer._balance_batch(stub, batch, metrics)  # verl pads to ppo_mini_batch_size x n = 4
    padded = len(batch.keys)
    assert padded % 4 == 0 and padded - k == sum(t.get("is_padding", False) for t in batch.tags)
    batch = PPOTrainer._compute_advantage(stub, batch, metrics)
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "rm_scores"])
    # the filter's own probabilities on the same scored batch
    r = torch.tensor([x for i in range(4) for x in SpreadRollouts.REWARDS[i]])
    gi = torch.arange(4).repeat_interleave(N)
    a = group_advantages(r, gi, AdvantageConfig(norm="group", unbiased_std=True, eps=1e-6))
    p = DPPOFilter(**DPPO_KW).inclusion_probs(ScoredBatch(r, a, gi))
    c = padded / (4 * N)
    for key, tag, adv, score in zip(
        batch.keys, batch.tags, data["advantages"].unbind(), data["rm_scores"].unbind()
    ):
        if tag.get("is_padding"):
            assert torch.all(adv == 0)
            continue
        prompt = int(key.split("x")[0][1:])
        row = prompt * N + SpreadRollouts.REWARDS[prompt].index(float(score.sum()))  # same reward: same A, p
        want = float(a[row] / p[row] * c)
        torch.testing.assert_close(adv, torch.full_like(adv, want), rtol=1e-5, atol=1e-6)
    want_stored = sorted(
        float(v) for v in stored[SEQ_ADV_FIELD].reshape(-1)
    )  # what the trainer mode restores
    got = sorted(
        float(d[0]) for t, d in zip(batch.tags, data["advantages"].unbind()) if not t.get("is_padding")
    )
    assert want_stored == pytest.approx(got, rel=1e-5, abs=1e-6)
    assert not advantage._FULL_GROUPS


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ((), "actor.loss_agg_mode='token-mean'"),  # verl's default
        (("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.use_kl_loss=True"),
         "actor.use_kl_loss=True"),
        (("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
          "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.refill_rounds=3"), "refill_rounds=3: dppo keeps rows at random"),
    ],
)  # fmt: skip
def test_dppo_is_refused_where_verl_cannot_keep_it_unbiased(store, extra, needle):
    from grpo_parts.errors import NotSupportedError

    cfg = dp_config(*extra, "trainer.n_gpus_per_node=1", name="dppo", kwargs=DPPO_KW)
    with pytest.raises(NotSupportedError) as e:
        PPOTrainer._build_replay_buffer(trainer_stub(cfg, SpreadRollouts("r")))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_prompt_skipping_is_refused_at_the_sampler_seam(store):
    """The sampler sees prompts only after verl submitted them: skipping there would be silently
    off, so it is refused in one line naming the trainer mode that serves it."""
    cfg = dp_config(
        "+trainer.v1.sampler.sampler_kwargs.grpo_parts_filter.prompt_skip=history",
        "trainer.n_gpus_per_node=1",
    )
    with pytest.raises(ValueError, match="trainer_mode=grpo_parts_sync") as e:
        PPOTrainer._build_replay_buffer(trainer_stub(cfg, SpreadRollouts("r")))
    assert "\n" not in str(e.value)
