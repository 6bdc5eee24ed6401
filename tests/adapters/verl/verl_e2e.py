"""Run verl 0.9.1's real trainer entry point (``python -m verl.trainer.main_ppo``, the default v1
sync trainer) on CPU with grpo_parts' parts, in a subprocess: a tiny Llama and a character tokenizer
saved to disk, a parquet of prompts, a rule reward, the test-only CPU platform plugin
(:mod:`verl_cpu_plugin`) loaded in every process. Returns the per-step metrics of verl's file logger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Longer completions score higher, plus the share of the ground-truth digit: completion lengths
    differ within almost every group of a random tiny model, so the policy moves at every step."""
    text = solution_str.strip()
    return min(len(text), 8) / 8 + sum(c == str(ground_truth) for c in text) / max(1, len(text))
'''


def build_assets(workdir: Path, n_prompts: int = 8, seed: int = 0) -> dict[str, Path]:
    import pandas as pd
    import torch
    from _cpu_verl import char_tokenizer

    from grpo_parts.tiny import tiny_causal_lm

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "model"
    vocab = 48
    model = tiny_causal_lm("llama", vocab_size=vocab, dtype=torch.float32, seed=seed)
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, 3
    model.save_pretrained(model_dir)
    char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 :?!.,-+=*/"[: vocab - 4]).save_pretrained(model_dir)
    rows = [
        {
            "data_source": "grpo_parts_e2e",
            "prompt": [{"role": "user", "content": f"repeat {i % 10}:"}],
            "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
            "extra_info": {"index": i},
        }
        for i in range(n_prompts)
    ]
    data = workdir / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    reward = workdir / "reward.py"
    reward.write_text(REWARD_FN)
    return {"model": model_dir, "data": data, "reward": reward}


def overrides(
    assets: dict[str, Path], workdir: Path, *, steps: int, batch: int, n: int, response: int
) -> list[str]:
    return [
        f"data.train_files={assets['data']}",
        f"data.val_files={assets['data']}",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=16",
        f"data.max_response_length={response}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets['model']}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no FlashAttention on CPU
        # FSDP2: FSDP1 stages its flat params to "<device>:<id>", which has no CPU spelling
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * n}",
        "actor_rollout_ref.actor.optim.lr=5e-2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch * n}",
        f"reward.custom_reward_function.path={assets['reward']}",
        "reward.custom_reward_function.name=compute_score",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        # torch.compile of the entropy kernel costs ~35 s per process on a 2-core CPU
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.num_gpus=1",  # a logical GPU: verl checks the count before placing workers
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def env(workdir: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        VERL_PLATFORM="cpu",
        VERL_ENGINE_DEVICE="cuda",  # the FSDP engines register for cuda/npu only; the platform answers cpu
        VERL_USE_EXTERNAL_MODULES="verl_cpu_plugin",
        PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT / "src"), e.get("PYTHONPATH", "")]),
        VERL_FILE_LOGGER_PATH=str(workdir / "metrics.jsonl"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        RAY_DEDUP_LOGS="0",
    )
    return e


def _finished(log: Path) -> bool:
    return log.exists() and "Final validation metrics" in log.read_text(errors="replace")


def main_ppo(
    workdir: Path, args: list[str], *, timeout: float = 900, grace: float = 60
) -> list[dict[str, Any]]:
    """``python -m verl.trainer.main_ppo *args`` on CPU in ``workdir``; verl's per-step metrics.

    Once verl has printed its final metrics, the run gets ``grace`` seconds to shut Ray down; a
    shutdown that hangs past that (seen now and then on a 2-core box) is ended with the process group."""
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args]
    log = workdir / "run.log"
    deadline, done_at = time.monotonic() + timeout, None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env(workdir), stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                                start_new_session=True)  # fmt: skip
        while proc.poll() is None:
            time.sleep(2)
            now = time.monotonic()
            if done_at is None and _finished(log):
                done_at = now
            if now > deadline or (done_at is not None and now - done_at > grace):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
    if not _finished(log):
        raise RuntimeError(f"verl main_ppo exited {proc.returncode}; log: {log}\n" + log.read_text()[-6000:])
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(workdir: Path, extra: list[str], *, steps: int = 2, batch: int = 4, n: int = 4, response: int = 8,
        timeout: float = 900) -> list[dict[str, Any]]:  # fmt: skip
    """The tiny-Llama run: ``steps`` GRPO steps of ``batch`` prompts x ``n``, plus ``extra`` overrides."""
    assets = build_assets(workdir, n_prompts=max(8, batch * (steps + 1)))
    args = overrides(assets, workdir, steps=steps, batch=batch, n=n, response=response)
    return main_ppo(workdir, [*args, *extra], timeout=timeout)


if __name__ == "__main__":
    out = run(Path(sys.argv[1]), sys.argv[2:])
    for row in out:
        print(json.dumps(row)[:2000])
