"""Prompt skipping behind verl (issue 44 item 6): the ``grpo_parts_sync`` trainer, built from verl's
own composed config, draws each step's prompts past the skipper (the step keeps
``train_batch_size`` prompts by drawing more), each kept row's stored advantage carries ``1 / p`` x
rolled-out / drawn, every rolled-out group reaches the history, ``parts/prompt_skip/prompts_skipped``
is counted, the history survives the checkpoint folder, and what cannot stay unbiased is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transfer_queue")
pytest.importorskip("verl.trainer.ppo.v1")

from grpo_parts_adapters.verl import kv_filter as kv  # noqa: E402
from grpo_parts_adapters.verl import trainer as tr  # noqa: E402
from grpo_parts_adapters.verl.filtering import FilterOptions, skip_reasons  # noqa: E402
from grpo_parts_adapters.verl.sampler import FilteringReplayBuffer  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from test_overrides import _compose  # noqa: E402
from test_plugin_trainer import FakeStore  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402

from grpo_parts.core import AdvantageConfig, group_advantages  # noqa: E402
from grpo_parts.errors import NotSupportedError  # noqa: E402

G, B, N_PROMPTS = 4, 4, 12
SEQ_MEAN = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"
SOLVED = set(range(6))  # every completion right: zero-variance groups


def _trainer(extra: list[str]) -> tr.GrpoPartsSyncTrainer:
    from grpo_parts_adapters.verl import plugin  # noqa: F401  (registers)
    from verl.trainer.ppo.v1 import get_trainer_cls

    cfg = _compose(
        [
            "trainer.v1.trainer_mode=grpo_parts_sync",
            "algorithm.adv_estimator=grpo",
            f"data.train_batch_size={B}",
            f"actor_rollout_ref.rollout.n={G}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            *extra,
        ]
    )
    return get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)


def _dataloader(trainer: tr.GrpoPartsSyncTrainer) -> None:
    """verl's ``_fetch_one_gen_batch`` over a 12-prompt dataset, ``B`` prompts a fetch, fresh uids."""
    from verl.utils import tensordict_utils as tu

    state = {"i": 0}

    def fetch():
        idx = [(state["i"] + j) % N_PROMPTS for j in range(B)]
        state["i"] += B
        raw = np.empty(B, dtype=object)
        raw[:] = [[{"role": "user", "content": f"problem {i}"}] for i in idx]
        uid = np.array([f"u{state['i']}_{j}" for j in range(B)], dtype=object)
        return tu.get_tensordict({"index": torch.tensor(idx), "raw_prompt": raw, "uid": uid})

    trainer._fetch_one_gen_batch = fetch  # type: ignore[method-assign]


def _rollout(store: FakeStore, batch) -> KVBatchMeta:
    """What the agent loop and reward would write for the submitted prompts: ``G`` rows each."""
    keys, tags = [], []
    gen = torch.Generator().manual_seed(len(store.rows))
    for i, uid in zip(batch["index"].tolist(), batch["uid"]):
        rewards = (
            [1.0] * G
            if i in SOLVED
            else [1.0, 0.0, *(torch.rand(G - 2, generator=gen) > 0.5).float().tolist()]
        )
        for j, r in enumerate(rewards):
            key = f"{uid}_{j}"
            store.put(key, str(uid), r, length=1 + j % 3)
            keys.append(key)
            tags.append({"uid": str(uid)})
    return KVBatchMeta(partition_id="train", keys=keys, tags=tags, extra_info={})


def test_skipping_alone_runs_behind_a_keep_all_filter_and_is_refused_with_verls_default_loss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opts = tr.filter_options_from(OmegaConf.create({"grpo_parts": {"filter": {"prompt_skip": "history"}}}))
    assert opts is not None and opts.name == "keep_all" and opts.parts.prompt_skip == "history"
    with pytest.raises(NotSupportedError, match="loss_agg_mode='token-mean'"):
        _trainer(["+grpo_parts.filter.prompt_skip=history"])  # verl's default token-mean
    reasons = skip_reasons(
        FilterOptions(
            name="keep_all", refill_rounds=1, loss_agg_mode="seq-mean-token-mean", use_kl_loss=True
        ),
        OmegaConf.create({"algorithm": {"filter_groups": {"enable": True}}}),
    )
    text = " | ".join(reasons)
    for fact in ("refill_rounds=1", "use_kl_loss", "filter_groups"):
        assert fact in text
    from grpo_parts.errors import GRPOPartsError

    with caplog.at_level("INFO", logger="grpo_parts.skip.stage"):  # not asked for: opt-in, and why
        _trainer(["+grpo_parts.filter.name=cppo"])
        _trainer(["+grpo_parts.filter.name=cppo", SEQ_MEAN])
    lines = [r.getMessage() for r in caplog.records if "prompt skipping" in r.getMessage()]
    assert len(lines) == 2 and "this run would refuse it: actor.loss_agg_mode='token-mean'" in lines[0]
    assert lines[1].endswith("; this run's loss would stay unbiased under it")
    fewer = "+grpo_parts.filter.prompt_skip_kwargs.step_size=fewer"  # verl trains whole steps
    with pytest.raises(GRPOPartsError, match="verl trains whole steps.*expected 'fill'"):
        _trainer(["+grpo_parts.filter.prompt_skip=history", SEQ_MEAN, fewer])


def test_trainer_skips_solved_prompts_weighs_the_kept_and_counts(tmp_path):
    trainer = _trainer(["+grpo_parts.filter.prompt_skip=history", SEQ_MEAN])
    assert trainer.grpo_parts_skip is not None and type(trainer.replay_buffer) is FilteringReplayBuffer
    _dataloader(trainer)
    store = FakeStore()
    opts, filt = trainer.grpo_parts_filter_options, trainer.grpo_parts_filter
    skipped = 0.0
    for step in range(9):
        trainer.global_steps = step + 1  # what verl's fit loop keeps
        batch = trainer._next_train_batch()
        assert len(batch) == B  # the step keeps its size by drawing more
        kb = _rollout(store, batch)
        kept, metrics = kv.filter_kv_batch(kb, filt, opts, store=store, skip=trainer.grpo_parts_skip)
        assert len(kept.keys) == B * G  # keep_all: every rolled-out row trains
        skipped += metrics["parts/prompt_skip/prompts_skipped"]
        # each row's stored advantage: its full group's GRPO advantage x 1/p x rolled-out / drawn
        fields = store.kv_batch_get(kept.keys, "train", ["uid", "rm_scores"])
        rewards = fields["rm_scores"].sum(-1).double()
        uids = list(fields["uid"])
        index = torch.tensor([list(dict.fromkeys(uids)).index(u) for u in uids])
        adv = group_advantages(rewards, index, AdvantageConfig(norm="group", eps=1e-6))
        weights = trainer.grpo_parts_skip.row_weights(uids)
        (r,) = trainer.grpo_parts_skip.draw.rounds
        per_prompt = weights.view(B, G)[:, 0]  # rows come prompt by prompt, in the submitted order
        torch.testing.assert_close(per_prompt, r.weights * B / r.drawn)
        seq = torch.stack([store.rows[k][kv.SEQ_ADV_FIELD] for k in kept.keys]).double()
        torch.testing.assert_close(seq, (adv * weights).float().double(), rtol=1e-5, atol=1e-6)
        for k in kept.keys:
            del store.rows[k]
    assert skipped > 0  # the solved prompts' zero-variance history skipped some of them

    trainer.grpo_parts_skip.save(str(tmp_path))
    fresh = _trainer(["+grpo_parts.filter.prompt_skip=history", SEQ_MEAN])
    assert fresh.grpo_parts_skip.load(str(tmp_path))
    assert (
        fresh.grpo_parts_skip.skipper.state_dict().keys()
        == trainer.grpo_parts_skip.skipper.state_dict().keys()
    )
    assert fresh.grpo_parts_skip.skipper.history_stats() == trainer.grpo_parts_skip.skipper.history_stats()
    assert not fresh.grpo_parts_skip.load(str(tmp_path / "missing"))  # logged, starts empty
