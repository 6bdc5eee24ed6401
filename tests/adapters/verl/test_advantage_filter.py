"""verl adapter: the ``grpo_parts_grpo`` estimator against verl's registered ``grpo``, and the v1
filter never handing verl an empty batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("verl")

from grpo_parts_adapters.verl import advantage  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402


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
    from grpo_parts_adapters.verl.kv_filter import filter_kv_batch
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
