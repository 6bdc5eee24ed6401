"""verl adapter: the ``grpo_parts_grpo`` estimator against verl's registered ``grpo``, and the
DataProto filter (legacy loop) leaving a batch verl's update accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("verl")

from grpo_parts_adapters.verl import advantage, filtering  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from grpo_parts.core import group_advantages  # noqa: E402


@st.composite
def verl_batches(draw, min_group: int = 2):
    """A DataProto as verl holds it after rewards: uid per row (groups interleaved, unequal sizes),
    right-padded response_mask, outcome reward on the last response token."""
    n_groups = draw(st.integers(1, 5))
    sizes = [draw(st.integers(min_group, 6)) for _ in range(n_groups)]
    uids = [f"u{g}" for g, s in enumerate(sizes) for _ in range(s)]
    perm = draw(st.permutations(range(len(uids))))
    uids = [uids[i] for i in perm]
    n, t = len(uids), draw(st.integers(1, 6))
    lengths = torch.tensor([draw(st.integers(1, t)) for _ in range(n)])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    # rewards from a small set so some groups are all-equal (zero variance) and ties happen
    r = torch.tensor([draw(st.sampled_from([0.0, 1.0, 0.5, 2.0])) for _ in range(n)], dtype=torch.float64)
    if draw(st.booleans()):
        r = r + torch.tensor([draw(st.floats(-1, 1, allow_nan=False)) for _ in range(n)], dtype=torch.float64)
    tlr = torch.zeros(n, t, dtype=torch.float64)
    tlr[torch.arange(n), lengths - 1] = r
    return DataProto.from_dict(
        tensors={
            "token_level_rewards": tlr,
            "response_mask": mask,
            "responses": torch.randint(0, 50, (n, t)),
            "old_log_probs": torch.randn(n, t, dtype=torch.float64),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def _verl_grpo(data: DataProto, norm: bool) -> torch.Tensor:
    fn = core_algos.get_adv_estimator_fn("grpo")
    adv, _ = fn(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=norm,
    )
    return adv


@given(verl_batches(), st.booleans())
def test_grpo_parts_estimator_equals_verl_grpo(data, norm):
    advantage.register()
    ours_fn = core_algos.get_adv_estimator_fn(advantage.NAME)
    ours, returns = ours_fn(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
        config={"norm_adv_by_std_in_grpo": norm},
    )
    theirs = _verl_grpo(data, norm)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    # verl divides an all-equal group's rounding residue by eps (|A| up to ~1e-10); we give exactly 0
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    assert torch.equal(ours, returns)


def test_estimator_documented_differences():
    """Singleton groups: verl gives r / (1 + eps), grpo_parts gives 0 (no relative signal)."""
    advantage.register()
    tlr = torch.tensor([[0.0, 3.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.long)
    uid = np.array(["a", "b", "b"], dtype=object)
    ours, _ = advantage.compute_grpo_parts_advantage(tlr, mask, uid, None)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(tlr, mask, uid)
    assert torch.all(ours[0] == 0)
    torch.testing.assert_close(theirs[0], torch.full((2,), 3.0 / (1 + 1e-6), dtype=torch.float64))
    torch.testing.assert_close(ours[1:], theirs[1:])


def test_estimator_rejects_bad_index():
    with pytest.raises(ValueError, match="index"):
        advantage.compute_grpo_parts_advantage(torch.zeros(2, 3), torch.ones(2, 3), None)
    with pytest.raises(ValueError, match="index: expected 2"):
        advantage.compute_grpo_parts_advantage(torch.zeros(2, 3), torch.ones(2, 3), ["a"])


@given(verl_batches(), st.integers(1, 12))
def test_cppo_filter_keeps_exact_topk_and_a_valid_dataproto(data, k):
    n = len(data)
    filt = filtering.build_filter("cppo", {"k": k})
    kept_data, sel = filtering.filter_data_proto(data, filt) if _has_signal(data) else (None, None)
    if kept_data is None:
        with pytest.raises(ValueError, match="kept 0 rows"):
            filtering.filter_data_proto(data, filt)
        return
    # exactly the top-k by |A| among rows with nonzero advantage (ties broken by lower row index)
    rewards = data.batch["token_level_rewards"].sum(-1)
    gi, _ = advantage.uid_to_group_index(data.non_tensor_batch["uid"])
    adv = group_advantages(rewards, gi)
    cand = [i for i in range(n) if adv[i] != 0]
    expect = sorted(sorted(cand, key=lambda i: (-abs(float(adv[i])), i))[:k])
    assert sel.kept.tolist() == expect
    # a DataProto verl accepts: same keys, trailing shapes and dtypes, uid subset in row order
    kept_data.check_consistency()
    assert set(kept_data.batch.keys()) == set(data.batch.keys()) | {"advantages", "returns"}
    assert set(kept_data.non_tensor_batch) == set(data.non_tensor_batch)
    for key in data.batch.keys():
        assert kept_data.batch[key].shape[1:] == data.batch[key].shape[1:]
        assert kept_data.batch[key].dtype == data.batch[key].dtype
        assert torch.equal(kept_data.batch[key], data.batch[key][torch.tensor(expect)])
    assert list(kept_data.non_tensor_batch["uid"]) == [data.non_tensor_batch["uid"][i] for i in expect]
    # advantages are those of the full groups (CPPO), not re-normalised within the kept rows
    mask = kept_data.batch["response_mask"].to(torch.float64)
    torch.testing.assert_close(kept_data.batch["advantages"], adv[torch.tensor(expect)][:, None] * mask)
    assert torch.equal(kept_data.batch["returns"], kept_data.batch["advantages"])
    # ... and verl's policy loss runs on the filtered batch
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    out = loss_fn(
        old_log_prob=kept_data.batch["old_log_probs"],
        log_prob=kept_data.batch["old_log_probs"].clone().requires_grad_(True),
        advantages=kept_data.batch["advantages"],
        response_mask=kept_data.batch["response_mask"],
        loss_agg_mode="token-mean",
        config=_actor_config(),
    )
    assert torch.isfinite(out[0])


def _has_signal(data: DataProto) -> bool:
    rewards = data.batch["token_level_rewards"].sum(-1)
    gi, _ = advantage.uid_to_group_index(data.non_tensor_batch["uid"])
    return bool((group_advantages(rewards, gi) != 0).any())


def _actor_config():
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1)


@given(verl_batches(), st.sampled_from(["zero_variance", "pods"]), st.integers(2, 4))
def test_other_filters_and_rounding_to_a_multiple(data, name, multiple):
    kwargs = {"m": 2} if name == "pods" else {}
    filt = filtering.build_filter(name, kwargs)
    if not _has_signal(data):
        return
    plain = filt.select(
        filtering.scored_batch(data.batch["token_level_rewards"].sum(-1), data.non_tensor_batch["uid"])
    )
    n_plain = int(plain.kept.numel())
    if n_plain < multiple and len(data) < multiple:
        with pytest.raises(ValueError, match="multiple_of"):
            filtering.filter_data_proto(data, filt, multiple_of=multiple)
        return
    kept_data, sel = filtering.filter_data_proto(data, filt, multiple_of=multiple)
    if len(data) >= -(-n_plain // multiple) * multiple:
        assert len(kept_data) % multiple == 0 and len(kept_data) >= n_plain
        assert set(plain.kept.tolist()) <= set(sel.kept.tolist())  # rounding up only adds rows
    assert sel.metrics["parts/filter/rows_kept"] == len(kept_data)


def test_filter_data_proto_errors_name_the_field():
    data = DataProto.from_dict(
        tensors={"x": torch.zeros(2, 1)}, non_tensors={"uid": np.array(["a", "a"], dtype=object)}
    )
    with pytest.raises(ValueError, match="token_level_rewards"):
        filtering.filter_data_proto(data, filtering.build_filter("cppo", {"k": 1}))
    with pytest.raises(ValueError, match="unknown implementation"):
        filtering.build_filter("nope")


@given(verl_batches(), st.integers(1, 4))
def test_legacy_dppo_kept_rows_train_on_weighted_full_group_advantages(data, multiple):
    """``filter_data_proto`` with the weighted ``dppo`` filter: rounded up only (re-added rows train
    with weight 0), every drawn row's advantage times ``1 / p`` times ``kept / rolled-out rows``."""
    from grpo_parts.filter.dppo import DPPOFilter

    kw = {"pruning_rate": 0.5, "seed": 1}
    opts = filtering.FilterOptions(name="dppo", loss_agg_mode="seq-mean-token-mean")
    scored = filtering.scored_batch(
        data.batch["token_level_rewards"].sum(-1), data.non_tensor_batch["uid"], data.batch["response_mask"]
    )
    res = DPPOFilter(**kw).select(scored)
    if res.kept.numel() == 0 or len(data) < multiple:
        return
    kept_data, sel = filtering.filter_data_proto(
        data, filtering.build_filter("dppo", kw), multiple_of=multiple, options=opts
    )
    k, n = len(kept_data), len(data)
    assert k % multiple == 0 and set(res.kept.tolist()) <= set(sel.kept.tolist())
    w = dict(zip(res.kept.tolist(), res.weights.tolist()))
    for j, row in enumerate(sel.kept.tolist()):
        want = float(scored.advantages[row]) * w.get(row, 0.0) * k / n
        adv = kept_data.batch["advantages"][j]
        torch.testing.assert_close(adv, want * kept_data.batch["response_mask"][j].to(adv.dtype))
    assert sel.metrics["parts/filter/weighted_rows"] == res.kept.numel()


def test_legacy_dppo_refuses_verls_default_token_mean():
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[1.0], [0.0]]), "response_mask": torch.ones(2, 1)},
        non_tensors={"uid": np.array(["a", "a"], dtype=object)},
    )
    with pytest.raises(ValueError, match="loss_agg_mode='token-mean'"):
        filtering.filter_data_proto(data, filtering.build_filter("dppo"))


class _DictStore:
    """TransferQueue's three calls the v1 filter makes, on a dict (no Ray)."""

    def __init__(self, rows: dict[str, dict]) -> None:
        self.rows, self.cleared = rows, []

    def kv_batch_get(self, keys, partition_id, select_fields):  # type: ignore[no-untyped-def]
        return {f: [self.rows[k][f] for k in keys] if f == "uid" else torch.stack([self.rows[k][f] for k in keys])
                for f in select_fields}  # fmt: skip

    def kv_batch_put(self, keys, partition_id, fields):  # type: ignore[no-untyped-def]
        for i, k in enumerate(keys):
            self.rows[k].update({f: fields[f][i] for f in fields.keys()})

    def kv_clear(self, keys, partition_id):  # type: ignore[no-untyped-def]
        self.cleared += list(keys)


def test_v1_filter_never_hands_verl_an_empty_batch():
    """Every group zero-variance: CPPO keeps nothing, and verl's balancer asserts on an empty batch
    (seen in verl's own trainer). The filter keeps one whole mini-batch of zero-advantage rows (an
    update that moves nothing, as the full batch's would) and counts the step."""
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.trainer import filter_kv_batch
    from transfer_queue import KVBatchMeta

    keys = [f"u{g}_{i}" for g in range(4) for i in range(4)]
    rows = {k: {"uid": k.split("_")[0], "rm_scores": torch.tensor([0.0, 1.0]), "response_mask": torch.ones(2)}
            for k in keys}  # fmt: skip
    batch = KVBatchMeta(
        partition_id="train", keys=keys, tags=[{"uid": k.split("_")[0]} for k in keys], extra_info={}
    )
    opts = FilterOptions(name="cppo", kwargs={"k": 8}, ppo_mini_batch_size=2, rollout_n=4, n_gpus_per_node=1)
    store = _DictStore(rows)
    kept, metrics = filter_kv_batch(batch, opts.build(), opts, store=store)
    assert len(kept.keys) == opts.batch_multiple > 0 and metrics["parts/filter/empty_batch_steps"] == 1.0
    assert all(float(rows[k]["grpo_parts_seq_advantage"]) == 0.0 for k in kept.keys)
