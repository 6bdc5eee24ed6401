"""Subprocess for test_openrlhf_deepspeed.py: OpenRLHF's real step on CPU (see _cpu_openrlhf.py).

``python _ds_worker.py OUT_DIR PORT`` writes ``OUT_DIR/results.pt``:

* ``step[(packing, parts_on, grouped)]``: one OpenRLHF policy update (DeepSpeed ZeRO-2,
  ``PolicyModelActor.fit``) on the same CPPO-filtered experiences, with the grpo_parts actor
  (shared-prefix attention; grouped micro-batches unless ``grouped`` is False) on or off: old
  log-probs, the step's status, the objective DeepSpeed optimised, parameters after the update.
* ``default``: OpenRLHF's ``PPOTrainer.fit`` in its default configuration (the launcher's parser and
  OpenRLHF's validation; CPU changes listed in DEFAULT_ARGV) with every part on: each step's
  status dict as OpenRLHF logs it, and the agent executor's weights against the actor's after
  ``fit`` (OpenRLHF's own weight sync, over gloo, into the launcher's rollout actor).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cpu_openrlhf import (  # noqa: E402
    LocalEngine,
    LocalGroup,
    cuda_index_zero,
    init_sync_group,
    make_strategy,
    setup_process,
)

G, PROMPTS = 4, 3
REWARDS = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.4, 0.0]  # prompt 1: zero variance


def parse(argv: list[str]) -> Any:
    from grpo_parts_adapters.openrlhf.launch import parse_args

    return parse_args(argv)[0]


def step_args(packing: bool, parts_on: bool, grouped: bool) -> Any:
    argv = ["--actor.model_name_or_path", "unused", "--reward.remote_url", "unused.py",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(G),
            "--rollout.batch_size", str(PROMPTS), "--rollout.micro_batch_size", str(G),
            "--train.batch_size", "6", "--train.micro_batch_size", "2", "--algo.kl.init_coef", "0",
            "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
            # Adam's first step is lr * g / (|g| + eps): with eps = 1 it is smooth in the gradient
            # (with 1e-8 it is lr * sign(g), which float noise flips where g ~ 0)
            "--actor.adam.lr", "0.1", "--actor.adam.eps", "1.0",
            "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
            "--grpo_parts.filter", "cppo", "--grpo_parts.filter_kwargs", '{"pruning_rate": 0.5}']  # fmt: skip
    if packing:
        argv.append("--ds.packing_samples")
    if parts_on:
        argv += [
            "--grpo_parts.attention",
            "shared_prefix",
            "--grpo_parts.group_rows",
            "auto" if grouped else "off",
        ]
    args = parse(argv)
    args.ds.param_dtype = "fp32"  # exact comparison; OpenRLHF's default bf16 runs in `default`
    return args


def policy_actor(args: Any, strategy: Any, model: torch.nn.Module, parts_on: bool) -> Any:
    """The tail of PolicyModelActor.init_model_from_pretrained on a model built here (its head loads
    a checkpoint, as `default` does), then the grpo_parts setup when on."""
    from grpo_parts_adapters.openrlhf.actor import GRPOPartsActor
    from grpo_parts_adapters.openrlhf.ray_actors import PolicyActorParts, _Policy
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    actor = (GRPOPartsActor if parts_on else Actor)(model, temperature=args.rollout.temperature)
    actor.packing_samples = args.ds.packing_samples
    cfg = dict(optim=args.actor.optim, muon=vars(args.actor.muon), adam=vars(args.actor.adam),
               lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
               min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=10)  # fmt: skip
    holder = (PolicyActorParts if parts_on else _Policy).__new__(PolicyActorParts if parts_on else _Policy)
    holder.strategy = strategy
    holder.actor, holder.actor_optim, holder.actor_scheduler = strategy.prepare((actor, cfg))
    holder.ema_model = None
    with cuda_index_zero():
        holder.trainer = ActorPPOTrainer(
            strategy, holder.actor, ema_model=None, actor_optim=holder.actor_optim,
            actor_scheduler=holder.actor_scheduler, micro_train_batch_size=args.train.micro_batch_size,
            eps_clip=args.actor.eps_clip, ema_beta=args.train.ema_beta, vllm_engines=None,
        )  # fmt: skip
    if parts_on:
        holder.grpo_parts_setup(args)
    return holder


def recording_maker(policy: Any, args: Any, strategy: Any) -> tuple[Any, Any, list[torch.Tensor]]:
    """``(group, maker, losses)``: the policy alone in a local group, grpo_parts' experience maker
    over it (no critic, reference or reward model, KL 0), and the list each micro-batch's policy
    loss is appended to (DeepSpeed divides each by the accumulation steps)."""
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    losses: list[torch.Tensor] = []
    policy.trainer.actor_loss_fn.register_forward_hook(lambda m, i, out: losses.append(out[0].detach()))
    group = LocalGroup(policy)
    maker = GRPOPartsExperienceMaker(
        group, None, None, None, FixedKLController(0.0), strategy, type("Tok", (), {"pad_token_id": 0})(),
        filter=OpenRLHFPartsConfig.from_args(args).build_filter(),
    )  # fmt: skip
    return group, maker, losses


def step(packing: bool, parts_on: bool, grouped: bool = True) -> dict[str, Any]:
    import ray
    from _openrlhf_helpers import rollout_samples, tiny_model

    from grpo_parts.wrappers import transformers_model as hf_model

    args = step_args(packing, parts_on, grouped)
    strategy = make_strategy(args)
    policy = policy_actor(args, strategy, tiny_model("qwen2", seed=0, dtype=torch.float32), parts_on)
    group, maker, losses = recording_maker(policy, args, strategy)
    samples = rollout_samples(torch.Generator().manual_seed(1), G, PROMPTS, REWARDS, env_tokens=True)
    for s in samples:
        s.rewards, s.scores = s.rewards.float(), s.scores.float()
    experiences = maker.make_experience_batch(samples)  # OpenRLHF's make_experience: old log-probs
    old = [
        (p, lp[m].tolist())
        for e in experiences
        for p, lp, m in zip(e.prompts, e.action_log_probs, e.action_mask)
    ]
    ray.get(group.async_run_method_batch("append", experience=experiences))
    before = {n: p.detach().clone() for n, p in hf_model(policy.actor.model).named_parameters()}
    torch.manual_seed(0)
    status = ray.get(group.async_run_method("fit", kl_ctl=0.0))[0]
    params = {n: p.detach().clone() for n, p in hf_model(policy.actor.model).named_parameters()}
    counters = policy.grpo_parts_counters() if parts_on else {}
    return {"old_logprobs": old, "status": status, "params": params, "params_before": before, "counters": counters,
            "kept": len(old), "group_calls": group.calls, "micro_batches": len(losses),
            "objective": float(sum(losses) / strategy.accumulated_gradient),
            "buffer_class": type(policy.trainer.replay_buffer).__name__}  # fmt: skip


def write_default_run(tmp: Path) -> list[str]:
    """A tiny Qwen2 checkpoint with a character tokenizer, prompts, an agent file; the argv."""
    from _openrlhf_helpers import char_tokenizer

    from grpo_parts.tiny import tiny_causal_lm

    tok = char_tokenizer()
    model = tiny_causal_lm("qwen2", vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=0)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    with open(tmp / "data.jsonl", "w") as f:
        for a, b in [(1, 2), (12, 3), (4, 40), (7, 7), (23, 1), (5, 16)]:
            f.write(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    (tmp / "agent.py").write_text(f"""import torch
from transformers import AutoModelForCausalLM
from grpo_parts.sampler import get_sampler_class
from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor


def reward(queries, prompts, labels):  # share of the label's characters right after "="
    out = []
    for q, label in zip(queries, labels):
        ans = q.split("=", 1)[-1]
        out.append(sum(a == b for a, b in zip(ans, label)) / len(label))
    r = torch.tensor(out)
    return {{"rewards": r, "scores": r, "extra_logs": {{}}}}


class AgentExecutor(GRPOPartsAgentExecutor):
    def __init__(self):
        load = lambda: AutoModelForCausalLM.from_pretrained({str(tmp / "model")!r})
        super().__init__(lambda: get_sampler_class("reference")(load()), reward_fn=reward, seed=0)
""")
    # OpenRLHF's defaults, except: sizes for a CPU minute; SDPA (flash-attn needs CUDA); weight sync
    # backend gloo (nccl needs CUDA; the sync itself is not run here, see _cpu_openrlhf)
    return ["--actor.model_name_or_path", str(tmp / "model"), "--train.agent_func_path", str(tmp / "agent.py"),
            "--data.prompt_dataset", str(tmp / "data.jsonl"), "--data.label_key", "label",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(G),
            "--rollout.batch_size", "2", "--train.batch_size", "8", "--rollout.max_new_tokens", "4",
            "--data.max_len", "24", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
            "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo", "--ds.attn_implementation", "sdpa",
            "--grpo_parts.attention", "shared_prefix", "--grpo_parts.filter", "cppo",
            "--grpo_parts.filter_kwargs", '{"pruning_rate": 0.5}', "--grpo_parts.refill_rounds", "1",
            "--grpo_parts.check_first_batch", "1"]  # fmt: skip


def default_run(tmp: Path) -> dict[str, Any]:
    from grpo_parts_adapters.openrlhf.ray_actors import PolicyActorParts, ReferenceActorParts, TrainerParts

    from grpo_parts.wrappers import transformers_model as hf_model

    args = parse(write_default_run(tmp))
    logged: list[dict[str, Any]] = []

    class Recording(TrainerParts):
        def save_logs_and_checkpoints(
            self, global_step: int, logs_dict: Any = None, client_states: Any = None
        ):
            logged.append({k: v for k, v in (logs_dict or {}).items() if isinstance(v, (int, float))})
            return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    policy, ref = PolicyActorParts.__new__(PolicyActorParts), ReferenceActorParts.__new__(ReferenceActorParts)
    actor_group, ref_group = LocalGroup(policy), LocalGroup(ref)
    engine = LocalEngine(args.train.agent_func_path)
    pretrain = args.actor.model_name_or_path
    trainer = Recording(
        pretrain, make_strategy(args), actor_group, None, None, ref_group, [engine], do_sample=True,
        max_len=args.data.max_len, max_new_tokens=args.rollout.max_new_tokens,
        temperature=args.rollout.temperature, top_p=args.rollout.top_p,
    )  # fmt: skip
    with cuda_index_zero():  # OpenRLHF's init_model_from_pretrained, as train() calls them
        policy.init_model_from_pretrained(make_strategy(args), pretrain, trainer.get_max_steps(), None)
        ref.init_model_from_pretrained(make_strategy(args), pretrain)
    # what init_model_from_pretrained(..., vllm_engines) does for one engine, over gloo
    policy.vllm_engines = [engine]
    init_sync_group(policy.trainer, [engine])
    trainer.fit()
    mine = dict(engine.executor.policy_copy.model.named_parameters())
    sampler_diff = max((mine[n].float() - p.float()).abs().max().item()
                       for n, p in hf_model(policy.actor.model).named_parameters())  # fmt: skip
    return {"logged": logged, "engine_calls": engine.calls, "actor_calls": actor_group.calls,
            "ref_calls": ref_group.calls, "actor_class": type(policy.actor).__name__,
            "buffer_class": type(policy.trainer.replay_buffer).__name__,
            "sampler_max_diff": sampler_diff, "weight_state": engine.actor.grpo_parts_weight_state()}  # fmt: skip


def main() -> None:
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    setup_process(port)
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results: dict[str, Any] = {"step": {}, "errors": {}}
    runs = [
        (False, False, True),
        (False, True, True),
        (True, False, True),
        (True, True, True),
        (False, True, False),
    ]
    for packing, parts_on, grouped in runs:  # (packing, parts on, grouped micro-batches when on)
        try:
            results["step"][packing, parts_on, grouped] = step(packing, parts_on, grouped)
        except Exception:
            results["errors"][f"step {packing=} {parts_on=} {grouped=}"] = traceback.format_exc()
    try:
        results["default"] = default_run(out)
    except Exception:
        results["errors"]["default"] = traceback.format_exc()
    torch.save(results, out / "results.pt")
    ray.shutdown()


if __name__ == "__main__":
    main()
