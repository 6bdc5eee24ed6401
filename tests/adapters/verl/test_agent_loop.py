"""verl adapter: the ``grpo_parts_agent`` loop produces output verl's agent-loop worker accepts
(``_agent_loop_postprocess`` + ``_postprocess`` -> DataProto), against a stand-in server manager."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("verl.experimental.agent_loop")

from _cpu_verl import char_tokenizer  # noqa: E402
from grpo_parts_adapters.verl import agent_loop as ours  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402

from grpo_parts.sampler.reference import ReferenceSampler  # noqa: E402
from grpo_parts.tiny import tiny_causal_lm  # noqa: E402

PROMPT_LEN, RESPONSE_LEN, VOCAB = 16, 6, 40
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"  # ids 4..39


def tiny_tokenizer():
    return char_tokenizer(CHARS)


_MODEL = None


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_causal_lm("qwen2", vocab_size=VOCAB, dtype=torch.float64, seed=3)
    return _MODEL


def trainer_config(path: str = "unused"):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": path},
                "rollout": {"prompt_length": PROMPT_LEN, "response_length": RESPONSE_LEN},
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


class StandInServerManager:
    """What verl's LLMServerClient offers the agent loop (``generate``), served by a grpo_parts
    sampler on a tiny model; records every request."""

    def __init__(self, tokenizer):
        self.server = ours.SamplerServer(
            ReferenceSampler(tiny_model()), (tokenizer.eos_token_id,), 0, RESPONSE_LEN
        )
        self.requests = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        return await self.server.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


def make_loop(tokenizer, server_manager, **kw):
    """The agent loop; an in-process sampler samples a fixed policy on purpose here (these tests
    compare it with a reference), so it is built with ``allow_frozen`` unless a test says otherwise."""
    if kw.get("sampler", "server") != "server":
        kw.setdefault("allow_frozen", True)
    ours.register_agent_loop()
    cfg = verl_agent_loop._agent_loop_registry[ours.NAME]
    assert cfg["_target_"] == "grpo_parts_adapters.verl.agent_loop.GrpoPartsAgentLoop"
    return ours.GrpoPartsAgentLoop(
        trainer_config=verl_agent_loop.DictConfigWrap(trainer_config()),
        server_manager=server_manager,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=verl_agent_loop.DictConfigWrap(trainer_config().data),
        **kw,
    )


def verl_worker(tokenizer):
    """verl's AgentLoopWorker with only the state its post-processing reads (no Ray, no servers)."""
    w = object.__new__(verl_agent_loop.AgentLoopWorker)
    w.tokenizer, w.processor = tokenizer, None
    w.rollout_config = trainer_config().actor_rollout_ref.rollout
    w.reward_loop_worker_handles = None
    w.distillation_enabled = False
    w.mm_processor_kwargs = {}
    w.teacher_client = None
    return w


PROMPTS = ["abc", "hello", "z9"]


async def _run_all(make, worker, params):
    loop = make()  # verl builds agent loops inside the worker's running event loop
    internal = []
    for i, text in enumerate(PROMPTS):
        for _ in range(2):  # rollout.n = 2: verl repeats each prompt
            kwargs = {"raw_prompt": [{"role": "user", "content": text}], "uid": f"u{i}"}
            out = await loop.run(params, **kwargs)
            assert isinstance(out, verl_agent_loop.AgentLoopOutput)
            internal.append(await worker._agent_loop_postprocess(out, False, **kwargs))
    return internal


@pytest.mark.parametrize("backend", ["stand_in_server", "local_reference"])
def test_agent_loop_output_is_accepted_by_verl_postprocess(backend):
    tok = tiny_tokenizer()
    server = StandInServerManager(tok)
    kw = (
        {}
        if backend == "stand_in_server"
        else {"sampler": "reference", "model_factory": f"{__name__}:tiny_model"}
    )
    worker = verl_worker(tok)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    internal = asyncio.run(_run_all(lambda: make_loop(tok, server, **kw), worker, params))
    uids = np.array([f"u{i}" for i in range(len(PROMPTS)) for _ in range(2)], dtype=object)
    data = worker._postprocess(internal, input_non_tensor_batch={"uid": uids})
    n = 2 * len(PROMPTS)
    assert len(server.requests) == (n if backend == "stand_in_server" else 0)
    b = data.batch
    assert b["prompts"].shape == (n, PROMPT_LEN) and b["responses"].shape == (n, RESPONSE_LEN)
    assert (
        b["input_ids"].shape
        == b["attention_mask"].shape
        == b["position_ids"].shape
        == (n, PROMPT_LEN + RESPONSE_LEN)
    )
    assert b["rollout_log_probs"].shape == (n, RESPONSE_LEN)
    assert list(data.non_tensor_batch["uid"]) == list(uids)
    data.check_consistency()
    # the prompts are the tokenizer's encoding of the chat template, left-padded
    for i, text in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        assert b["prompts"][2 * i, PROMPT_LEN - len(ids) :].tolist() == ids
    # rollout log-probs are the policy's: recompute them with a plain forward
    model = tiny_model()
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    lp = (
        torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1].double(), -1)
        .gather(-1, b["responses"][..., None])
        .squeeze(-1)
    )
    m = b["response_mask"].bool()
    torch.testing.assert_close(
        b["rollout_log_probs"][m].double(), lp[m], rtol=0, atol=1e-5
    )  # stored as float32


def test_verl_worker_generate_sequences_and_manager_merge():
    """The whole verl path above the servers: AgentLoopWorker.generate_sequences (dispatch by
    ``agent_name`` through verl's registry and hydra, trajectory info, post-processing) on two
    chunks, merged and summarised as AgentLoopManager.generate_sequences does."""
    from verl import DataProto

    tok = tiny_tokenizer()
    ours.register_agent_loop()
    cfg = trainer_config()
    cfg.actor_rollout_ref.rollout.update(
        {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "calculate_log_probs": True,
            "agent": {"default_agent_loop": ours.NAME},
            "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0},
        }
    )

    def worker():
        w = verl_worker(tok)
        w.config, w.rollout_config = cfg, cfg.actor_rollout_ref.rollout
        w.llm_client, w.dataset_cls, w.hf_model_type, w.tools = StandInServerManager(tok), None, None, []
        return w

    texts = ["abc", "abc", "xy", "xy"]
    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    prompts = DataProto.from_dict(
        non_tensors={
            "raw_prompt": raw,
            "uid": np.array(["a", "a", "b", "b"], dtype=object),
            "index": np.array([0, 0, 1, 1]),
        }
    )

    async def manager():
        outs = [await worker().generate_sequences(chunk) for chunk in prompts.chunk(2)]
        merged = DataProto.concat(outs)
        metrics = [o.meta_info.pop("metrics") for o in outs]
        timing = object.__new__(verl_agent_loop.AgentLoopManager)._performance_metrics(metrics, merged)
        return merged, timing

    out, timing = asyncio.run(manager())
    assert len(out) == 4 and list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert set(out.non_tensor_batch["agent_name"]) == {ours.NAME}
    assert out.batch["rollout_log_probs"].shape == (4, RESPONSE_LEN)
    assert "agent_loop/generate_sequences/mean" in timing


def test_greedy_local_sampler_equals_stand_in_server():
    tok = tiny_tokenizer()
    server = StandInServerManager(tok)
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    kwargs = {"raw_prompt": [{"role": "user", "content": "hello"}]}

    async def both():
        a = make_loop(tok, server)
        b = make_loop(tok, server, sampler="reference", model_factory=f"{__name__}:tiny_model")
        return await a.run(greedy, **kwargs), await b.run(greedy, **kwargs)

    out_a, out_b = asyncio.run(both())
    assert out_a.response_ids == out_b.response_ids and out_a.prompt_ids == out_b.prompt_ids


def test_concurrent_requests_are_batched_and_match_one_by_one():
    """verl runs the agent loops of a batch concurrently; the in-process sampler batches them."""
    tok = tiny_tokenizer()
    server = StandInServerManager(tok).server
    greedy = server.params({"temperature": 0.0})
    prompts = [tok(t)["input_ids"] for t in ["abc", "hello", "z9", "q", "longer prompt"]]

    async def concurrent():
        return await asyncio.gather(
            *[
                server.generate(str(i), prompt_ids=p, sampling_params={"temperature": 0.0})
                for i, p in enumerate(prompts)
            ]
        )

    together = asyncio.run(concurrent())
    assert max(server.batch_sizes) > 1  # several requests went through one sampler call
    for p, out in zip(prompts, together):
        alone = server.generate_batch(greedy, [p])[0]
        assert out.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(out.log_probs), torch.tensor(alone.log_probs), rtol=0, atol=1e-9
        )


def test_sampler_errors_reach_every_waiting_request():
    tok = tiny_tokenizer()
    server = StandInServerManager(tok).server

    async def run():
        return await asyncio.gather(
            server.generate("a", prompt_ids=[], sampling_params={}),
            server.generate("b", prompt_ids=[5], sampling_params={}),
            return_exceptions=True,
        )

    a, b = asyncio.run(run())
    assert isinstance(a, ValueError) and "prompt_ids" in str(a)
    assert isinstance(b, ValueError) or hasattr(b, "token_ids")


def tiny_draft(policy):
    from grpo_parts.draft.reference import FrozenLMDraft

    return FrozenLMDraft(tiny_causal_lm("qwen2", vocab_size=VOCAB, dtype=torch.float64, seed=7, num_layers=1))


def test_speculative_sampler_in_the_agent_loop_is_greedy_identical():
    from grpo_parts.sampler import IMPLEMENTATIONS

    if "speculative" not in IMPLEMENTATIONS:
        pytest.skip("the 'speculative' sampler has not landed in grpo_parts.sampler.IMPLEMENTATIONS")
    tok = tiny_tokenizer()
    server = StandInServerManager(tok)
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    kwargs = {"raw_prompt": [{"role": "user", "content": "abcabc"}]}

    async def both():
        ref = make_loop(tok, server)
        spec = make_loop(
            tok,
            server,
            sampler="speculative",
            draft_factory=f"{__name__}:tiny_draft",
            model_factory=f"{__name__}:tiny_model",
        )
        return await ref.run(greedy, **kwargs), await spec.run(greedy, **kwargs)

    out_ref, out_spec = asyncio.run(both())
    assert out_spec.response_ids == out_ref.response_ids
    torch.testing.assert_close(
        torch.tensor(out_spec.response_logprobs), torch.tensor(out_ref.response_logprobs), rtol=0, atol=1e-9
    )


def test_documented_agent_loop_yaml_instantiates_as_verl_does(tmp_path):
    """verl loads ``rollout.agent.agent_loop_config_path`` with OmegaConf and instantiates the entry
    with hydra, passing the worker's objects (see AgentLoopWorker._run_agent_loop)."""
    import hydra
    from omegaconf import OmegaConf

    path = tmp_path / "agent_loops.yaml"
    path.write_text(
        "- name: grpo_parts_agent\n"
        "  _target_: grpo_parts_adapters.verl.agent_loop.GrpoPartsAgentLoop\n"
        "  sampler: reference\n"
        f"  model_factory: {__name__}:tiny_model\n"
        "  allow_frozen: true\n"
    )
    (entry,) = OmegaConf.load(path)
    tok = tiny_tokenizer()

    async def run():
        loop = hydra.utils.instantiate(
            config=entry,
            trainer_config=verl_agent_loop.DictConfigWrap(config=trainer_config()),
            server_manager=None,
            tokenizer=tok,
            processor=None,
            hf_model_type=None,
            dataset_cls=None,
            data_config=verl_agent_loop.DictConfigWrap(trainer_config().data),
            tools=verl_agent_loop.ToolListWrap([]),
        )
        assert isinstance(loop, ours.GrpoPartsAgentLoop) and loop.sampler_name == "reference"
        return await loop.run({"temperature": 0.0}, raw_prompt=[{"role": "user", "content": "abc"}])

    out = asyncio.run(run())
    assert 1 <= len(out.response_ids) <= RESPONSE_LEN and len(out.response_logprobs) == len(out.response_ids)


def test_sampling_params_translation():
    p = ours.sampling_params_from_verl({"temperature": 0.7, "top_k": -1, "top_p": 0.9}, 5, (1,), 0)
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens, p.group_size) == (0.7, 0, 0.9, 5, 1)
    with pytest.raises(ValueError, match="model_factory"):
        ours._load("no_colon")


def test_in_process_sampler_refuses_a_rollout_verl_never_syncs():
    """verl's weight sync never reaches the agent loop's own policy copy: without the explicit
    opt-in every rollout is refused in one line that names the reason and the backend to use."""
    from grpo_parts.doors.policy_copy import StaleWeightsError

    tok = tiny_tokenizer()
    kwargs = {"raw_prompt": [{"role": "user", "content": "abc"}]}
    factory = f"{__name__}:tiny_model"

    async def refused():
        loop = make_loop(
            tok, StandInServerManager(tok), sampler="reference", model_factory=factory, allow_frozen=False
        )
        return await loop.run({"temperature": 0.0}, **kwargs)

    async def frozen():
        loop = make_loop(tok, StandInServerManager(tok), sampler="reference", model_factory=factory)
        return await loop.run({"temperature": 0.0}, **kwargs)

    with pytest.raises(StaleWeightsError) as e:
        asyncio.run(refused())
    msg = str(e.value)
    assert "\n" not in msg and "rollout.name=grpo_parts" in msg and "allow_frozen" in msg
    asyncio.run(frozen())
    (server,) = [v for k, v in ours._LOCAL_SERVERS.items() if k[0] == factory and k[1] == "reference"]
    assert server.totals["frozen_rollouts"] >= 1


def test_media_with_a_prompt_is_refused_never_dropped():
    """verl's server ``generate`` carries ``image_data`` / ``video_data`` for a vision-language
    policy: the grpo_parts server rolls out token ids only, so it refuses them in one line instead
    of sampling without the images."""
    from grpo_parts.errors import NotSupportedError

    server = ours.SamplerServer(ReferenceSampler(tiny_model()), (1,), 0, RESPONSE_LEN)
    with pytest.raises(NotSupportedError, match="verl passed image_data with the prompt"):
        asyncio.run(server.generate("r0", prompt_ids=[3, 4], sampling_params={}, image_data=[object()]))
    out = asyncio.run(server.generate("r1", prompt_ids=[3, 4], sampling_params={}, image_data=None))
    assert len(out.token_ids) >= 1  # text prompts are served as before
