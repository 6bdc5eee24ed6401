"""``rollout.name=grpo_parts`` in-process (no Ray): the server's policy copy follows the weights the
actor sends, refuses rollouts from stale weights in one line, and the worker-side adapter streams the
actor's parameters in buckets (every rank drains the stream, rank 0 of a replica sends)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from _cpu_verl import save_tiny_model  # noqa: E402
from grpo_parts_adapters.verl import rollout as ours  # noqa: E402

from grpo_parts.doors.policy_copy import StaleWeightsError  # noqa: E402
from grpo_parts.errors import GRPOPartsError  # noqa: E402

pytestmark = pytest.mark.frameworks


def _config(**options: Any) -> SimpleNamespace:
    return SimpleNamespace(
        engine_kwargs={"grpo_parts": {"sampler": "speculative", "draft": "ngram", **options}},
        load_format="dummy", response_length=6, tensor_model_parallel_size=1, data_parallel_size=1,
        pipeline_model_parallel_size=1, checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=1),
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("m") / "model"))


def _server(model_dir: str, **options: Any) -> ours.GRPOPartsServer:
    return ours.GRPOPartsServer(
        _config(**options), SimpleNamespace(path=model_dir, local_path=model_dir, tokenizer=None)
    )


def _actor(model_dir: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


async def _sync(server: ours.GRPOPartsServer, actor: torch.nn.Module, prefix: str = "") -> None:
    """What verl's FSDP engine hands the adapter: ``(name, tensor)`` pairs (FSDP-wrapped names here)."""
    items = [(prefix + k, v) for k, v in actor.state_dict().items()]
    await server.update_weights(items[:3], True, False)
    await server.update_weights(items[3:], False, True, ours.checksum(items))


def _generate(server: ours.GRPOPartsServer) -> Any:
    return server.generate("r", prompt_ids=[5, 6, 7], sampling_params={"temperature": 1.0})


def _assert_equal_weights(server: ours.GRPOPartsServer, actor: torch.nn.Module) -> None:
    ours_ = server.copy.model.state_dict()
    for k, v in actor.state_dict().items():
        torch.testing.assert_close(ours_[k], v, rtol=0, atol=0)


def test_server_refuses_until_the_actor_syncs_and_after_each_update(model_dir: str) -> None:
    server = _server(model_dir)

    async def go() -> None:
        with pytest.raises(StaleWeightsError) as e:
            await _generate(server)
        assert "\n" not in str(e.value) and "allow_frozen" in str(e.value)
        for step in range(2):
            actor = _actor(model_dir, seed=step)
            await _sync(server, actor, prefix="_fsdp_wrapped_module.")
            _assert_equal_weights(server, actor)
            out = await _generate(server)
            assert out.extra_fields["grpo_parts_stats"]["weight_syncs"] == step + 1
            await server.sleep()  # verl: after sampling, before the actor's update
            with pytest.raises(StaleWeightsError, match="actor was updated"):
                await _generate(server)

    asyncio.run(go())


def test_a_sync_that_misses_a_parameter_or_sends_a_foreign_one_is_refused(model_dir: str) -> None:
    server = _server(model_dir)
    items = list(_actor(model_dir, 0).state_dict().items())

    async def go() -> None:
        with pytest.raises(GRPOPartsError, match="untouched"):
            await server.update_weights(items[1:], True, True)
        with pytest.raises(StaleWeightsError):
            await _generate(server)
        with pytest.raises(GRPOPartsError, match="does not have"):
            await server.update_weights([("not.a.weight", torch.zeros(1))], True, True)

    asyncio.run(go())


def test_frozen_sampler_is_an_explicit_opt_in_and_counted(model_dir: str) -> None:
    with pytest.raises(ValueError, match="follow_actor"):
        ours.RolloutOptions(follow_actor=False)
    server = _server(model_dir, follow_actor=False, allow_frozen=True)

    async def go() -> None:
        await _sync(server, _actor(model_dir, 0))  # dropped: the control run's copy stays the checkpoint
        await _generate(server)

    asyncio.run(go())
    assert server.totals()["frozen_rollouts"] == 1 and server.totals()["ignored_syncs"] == 1


class _Handle:
    """A Ray actor handle stand-in: ``handle.method.remote(...)`` awaits the server's method."""

    def __init__(self, server: ours.GRPOPartsServer) -> None:
        self.server = server

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.server, name)
        return SimpleNamespace(remote=lambda *a, **k: fn(*a, **k))


def test_worker_adapter_streams_the_actor_in_buckets(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server(model_dir, sync_log=None)
    calls: list[tuple[int, bool, bool]] = []
    orig = server.update_weights

    async def counted(bucket: Any, first: bool, last: bool, sent: Any = None) -> int:
        calls.append((len(bucket), first, last))
        return await orig(bucket, first, last, sent)

    monkeypatch.setattr(server, "update_weights", counted)
    monkeypatch.setenv("RANK", "0")
    adapter = ours.GRPOPartsRollout(_config(), SimpleNamespace(), None)
    adapter._server = _Handle(server)
    actor = _actor(model_dir, 3)
    big = {k: v for k, v in actor.state_dict().items()}

    async def go() -> None:
        await adapter.update_weights(iter(big.items()), global_steps=4)
        await _generate(server)

    buckets = ours._buckets
    with monkeypatch.context() as m:  # 2 KiB buckets: several for this model
        m.setattr(ours, "_buckets", lambda w, n: buckets(w, 2048))
        asyncio.run(go())
    assert calls[0][1] and calls[-1][2] and len(calls) > 1 and sum(c[0] for c in calls) == len(big)
    _assert_equal_weights(server, actor)
    assert server.global_steps == 4
    with pytest.raises(GRPOPartsError, match="LoRA"):
        asyncio.run(adapter.update_weights(iter(big.items()), peft_config={"r": 8}))


def test_hydra_overrides_name_the_backend_and_validate_options() -> None:
    out = ours.hydra_overrides(sampler="speculative", draft="eagle", sampler_kwargs={"max_draft_tokens": 4})
    assert out[0] == "actor_rollout_ref.rollout.name=grpo_parts"
    assert "+actor_rollout_ref.rollout.engine_kwargs.grpo_parts.sampler_kwargs.max_draft_tokens=4" in out
    with pytest.raises(ValueError, match="max_batch"):
        ours.hydra_overrides(max_batch=0)


def test_sampler_metrics_sum_each_replicas_latest_totals() -> None:
    extras = [
        {"grpo_parts_totals": {"replica": 0.0, "weight_syncs": 2.0, "verify_steps": 5.0}},
        {"grpo_parts_totals": {"replica": 0.0, "weight_syncs": 3.0, "verify_steps": 7.0}},
        {"grpo_parts_totals": {"replica": 1.0, "weight_syncs": 3.0, "verify_steps": 1.0}},
        {"turn_scores": []},  # a sample from another backend
    ]
    assert ours.sampler_metrics(extras) == {
        "parts/sampler/weight_syncs": 6.0,
        "parts/sampler/verify_steps": 8.0,
    }
