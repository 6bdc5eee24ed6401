"""Test helpers: run verl 0.9.1's real FSDP engine on CPU (gloo process group of world size 1, verl's
device helpers pointed at CPU for the duration of a ``with verl_on_cpu():`` block) and build the
micro-batch data verl's v1 agent loop writes into TransferQueue."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase

_CPU_MODULE = SimpleNamespace(
    max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0,
    memory_allocated=lambda *a, **k: 0,
    memory_reserved=lambda *a, **k: 0,
    synchronize=lambda *a, **k: None,
    empty_cache=lambda *a, **k: None,
    is_available=lambda: True,
    current_device=lambda: "cpu",
    device_count=lambda: 1,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    # verl's checkpoint restores the "device" RNG under the platform's device name ("cpu" here)
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "cpu",
)


class CPUPlatform(PlatformBase):
    """verl's platform interface answered for the CPU (what verl's device helpers delegate to)."""

    device_name = "cpu"  # type: ignore[assignment]
    vendor_name = "cpu"  # type: ignore[assignment]
    device_module = _CPU_MODULE  # type: ignore[assignment]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str) -> Any:
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def verl_on_cpu() -> Iterator[None]:
    """verl's device helpers answer "cpu", engines are looked up as on CUDA (the FSDP engines
    register for cuda/npu only), and a one-rank gloo process group exists (unless the caller made
    one); all undone on exit. FSDP1's ``sync_module_states`` check for accelerator tensors is
    skipped: gloo broadcasts CPU tensors.
    verl's model patch also skips TRL's value head (TRL 1.x moved it; verl's import would fail), and
    the CPU offload FSDP2 forces on forward-only (reference) engines does not pin memory (pinning
    needs an accelerator)."""
    import verl.models.transformers.monkey_patch as mp
    import verl.workers.engine.fsdp.transformer_impl as ti

    mpatch = pytest.MonkeyPatch()
    port = str(_free_port())
    try:
        mpatch.setattr(platform_manager, "_current_platform", CPUPlatform())
        mpatch.setattr(ti, "device_name", "cpu")
        mpatch.setattr(mp, "is_trl_available", lambda: False)
        import torch.distributed.fsdp._init_utils as fsdp1_init

        mpatch.setattr(fsdp1_init, "_check_module_states_for_sync_module_states", lambda states: None)
        offload = ti.CPUOffloadPolicy
        mpatch.setattr(ti, "CPUOffloadPolicy", lambda pin_memory=True: offload(pin_memory=False))
        own_pg = not dist.is_initialized()  # else: a multi-rank worker made its group (and env) itself
        env = {
            "WORLD_SIZE": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for k, v in {"VERL_ENGINE_DEVICE": "cuda", **(env if own_pg else {})}.items():
            mpatch.setenv(k, v)
        if own_pg:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            yield
        finally:
            if own_pg:
                dist.destroy_process_group()
    finally:
        mpatch.undo()


def save_tiny_model(path: str, *, vocab: int = 48, seed: int = 0, value_head: bool = False) -> str:
    """A tiny Qwen2 (or its token-classification value model) and a character tokenizer in ``path``."""
    from grpo_parts.tiny import tiny_causal_lm

    os.makedirs(path, exist_ok=True)
    model = tiny_causal_lm("qwen2", vocab_size=vocab, dtype=torch.float32, seed=seed, num_kv_heads=2)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    with torch.no_grad():  # larger weights: attention far from uniform, so a wrong mask shows
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 :?!.,-+=*/"[: vocab - 4]).save_pretrained(path)
    return path


def char_tokenizer(chars: str) -> Any:
    """One token per character of ``chars`` after ``<pad> <eos> <unk> <bos>`` (ids 0-3), with a chat
    template that concatenates the messages (verl's agent loop applies one)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<bos>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *chars])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", bos_token="<bos>"
    )
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return hf


def agent_loop_worker() -> Any:
    """verl's v1 ``AgentLoopWorkerTQ`` with only the state its ``_agent_loop_postprocess`` reads
    (no Ray actor, no servers): what it writes into TransferQueue is what the v1 trainer trains on."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    w = object.__new__(AgentLoopWorkerTQ.__ray_actor_class__)
    w.processor = None
    w.reward_loop_worker_handles = None
    w.distillation_enabled = False
    w.mm_processor_kwargs = {}
    return w


def rollouts(
    n_prompts: int, n: int, *, vocab: int = 48, seed: int = 0, prefix: str = "uid"
) -> list[tuple[str, list[int], list[int]]]:
    """``(uid, prompt_ids, response_ids)``: ``n`` completions of each prompt, varied lengths; uids
    ``{prefix}{i}`` (TransferQueue keys derive from them: use a fresh prefix per batch)."""
    g = torch.Generator().manual_seed(seed)

    def toks(lo: int, hi: int) -> list[int]:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return torch.randint(4, vocab, (k,), generator=g).tolist()

    out = []
    for p in range(n_prompts):
        prompt = toks(3, 9)
        out += [(f"{prefix}{p}", prompt, toks(1, 7)) for _ in range(n)]
    return out


def put_rollouts(
    rows: list[tuple[str, list[int], list[int]]],
    *,
    partition: str = "train",
    step: int = 1,
    rewards: list[float] | None = None,
) -> Any:
    """Write ``rows`` into TransferQueue through verl's own v1 agent-loop post-processing (reward
    ``rewards[i]``, default ``len(response) % 2``); returns the ``KVBatchMeta`` verl's replay buffer
    would hand the trainer."""
    import asyncio

    import transfer_queue as tq
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    w = agent_loop_worker()
    keys, tags = [], []
    session: dict[str, int] = {}

    async def run() -> None:
        for j, (uid, prompt, resp) in enumerate(rows):
            sid = session.setdefault(uid, 0)
            session[uid] += 1
            out = AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=resp,
                response_mask=[1] * len(resp),
                reward_score=float(len(resp) % 2) if rewards is None else float(rewards[j]),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields={"reward_extra_info": {}},
            )
            kwargs = {"uid": uid, "session_id": sid, "global_steps": step, "index": 0, "data_source": "t"}
            await w._agent_loop_postprocess(out, partition == "val", **kwargs)
            keys.append(f"{uid}_{sid}_0")
            tags.append({"uid": uid, "seq_len": len(prompt) + len(resp)})

    asyncio.run(run())
    return tq.KVBatchMeta(partition_id=partition, keys=keys, tags=tags, extra_info={})


def with_info(meta: Any, info: dict[str, Any]) -> Any:
    """``meta`` with ``extra_info`` replaced (what the trainer sets before each worker call)."""
    return type(meta)(
        partition_id=meta.partition_id, keys=list(meta.keys), tags=list(meta.tags), extra_info=dict(info)
    )


def submit_prompts(
    rows: list[tuple[str, list[int], list[int]]], rewards: list[float], *, step: int = 1
) -> int:
    """What verl's trainer and agent loop do for freshly submitted prompts, in TransferQueue: each
    prompt registered (``is_prompt``, pending), its rollouts written by the agent loop's
    post-processing, then the prompt marked finished (as ``AgentLoopWorkerTQ._run_prompt``)."""
    import transfer_queue as tq

    uids = list(dict.fromkeys(u for u, _, _ in rows))
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    put_rollouts(rows, step=step, rewards=rewards)
    for u in uids:
        tq.kv_put(key=u, partition_id="train", tag={"status": "finished"})
    return len(uids)


def with_ppo_inputs(
    data: Any, *, dynamic: bool, remove_padding: bool, seed: int, micro_batch: int, global_batch: int
) -> Any:
    """``data`` (a micro-batch as verl's worker receives it) plus the PPO inputs of a step: random
    old log-probs and advantages per response token (seeded), and the engine's settings."""
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    lens = data["responses"].offsets().diff().tolist()
    data["old_log_probs"] = torch.nested.nested_tensor(
        [-torch.rand(n, generator=g) - 1.0 for n in lens], layout=torch.jagged
    )
    data["advantages"] = torch.nested.nested_tensor(
        [torch.randn(n, generator=g) for n in lens], layout=torch.jagged
    )
    tu.assign_non_tensor(
        data,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=dynamic,
        micro_batch_size_per_gpu=micro_batch,
        max_token_len_per_gpu=40,
        use_fused_kernels=False,
        temperature=0.9,
        calculate_entropy=True,
        global_batch_size=global_batch,
    )
    return data
