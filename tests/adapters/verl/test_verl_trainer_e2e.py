"""verl's real trainer entry point (``python -m verl.trainer.main_ppo``, default v1 sync trainer) with
grpo_parts' sampler as the rollout backend (``rollout.name=grpo_parts``) on CPU, end to end.

Each run is a subprocess (:mod:`verl_e2e`: tiny Llama, character tokenizer, a test-only CPU platform
plugin). Asserted per step: the copy the sampler rolls out from holds exactly the weights the actor
sent (checksums in the server's ``sync_log``), verl's own rollout-vs-actor probability difference
stays at numerical noise, and the parts ran (speculation, lean forward, the shared-prefix engine
hook, the filter); a checkpointed run resumed by a second ``main_ppo`` rolls out from the
checkpointed actor. The control run drops the syncs (``follow_actor: false``): the difference grows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from grpo_parts_adapters.verl.config import hydra_overrides as attention_overrides  # noqa: E402
from grpo_parts_adapters.verl.rollout import hydra_overrides as rollout_overrides  # noqa: E402
from grpo_parts_adapters.verl.sampler import buffer_overrides  # noqa: E402
from grpo_parts_adapters.verl.sampler import hydra_overrides as filter_overrides  # noqa: E402
from verl_e2e import run  # noqa: E402

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(1200)]

#: verl's training/rollout_probs_diff_max between the rollout's and the actor's probabilities: the
#: actor recomputes in bf16 (verl's default mixed precision), so equal weights differ by ~5e-4
SYNCED_TOL = 5e-3


def _metric(row: dict[str, Any], key: str) -> float:
    return float(row.get("data", row)[key])


def _syncs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_verl_trainer_every_part_on_follows_the_actor_and_resumes(tmp_path: Path) -> None:
    """Every part on for 3 steps, checkpointed at the end; then verl's resume (a second ``main_ppo``,
    ``trainer.resume_mode=auto``, same checkpoint folder) continues at step 4, and before its first
    rollout the sampler's copy receives the checkpointed actor -- what the first run's last sync
    sent -- not the model path's initial weights."""
    from verl_e2e import build_assets, main_ppo, overrides

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    assets = build_assets(tmp_path, n_prompts=20)
    parts = [*attention_overrides("shared_prefix"), *filter_overrides("cppo", {"k": 8})]

    def args(workdir: Path, steps: int) -> list[str]:
        base = overrides(assets, workdir, steps=steps, batch=4, n=4, response=8)
        base = [a for a in base if not a.startswith(("trainer.save_freq=", "trainer.default_local_dir="))]
        log = str(workdir / "syncs.jsonl")
        return [*base, *rollout_overrides(sampler="speculative", draft="ngram", sync_log=log), *parts,
                "trainer.save_freq=3", "trainer.resume_mode=auto", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]  # fmt: skip

    rows = main_ppo(first, args(first, 3))
    assert len(rows) == 3
    for step, row in enumerate(rows, start=1):  # the rollout's log-probs are the actor's, every step
        assert _metric(row, "training/rollout_probs_diff_max") < SYNCED_TOL
        # verl's metrics carry the backend's counters: a sync before every step's rollout
        assert _metric(row, "parts/sampler/weight_syncs") >= step
        assert _metric(row, "parts/sampler/lean_forward_calls") > 0
        # the shared-prefix engine hook ran every micro-batch; which layout (grid or padding-free) is
        # the planner's cost model's choice for the rollout's lengths, so it is not pinned here
        hook = {k: v for k, v in row["data"].items() if k.startswith("actor/parts/")}
        assert _metric(row, "actor/parts/attention/forwards") > 0, hook
        assert _metric(row, "actor/parts/attention/fallbacks") == 0, hook
        assert _metric(row, "parts/filter/rows_kept") > 0  # CPPO kept rows
    syncs = _syncs(first / "syncs.jsonl")
    assert len(syncs) >= 3  # before the first rollout (on_init_end) and after each update
    for s in syncs:  # the copy holds exactly what the actor sent
        assert s["copy_checksum"] == pytest.approx(s["sent_checksum"], rel=1e-12, abs=1e-9)
    assert len({round(s["copy_checksum"], 6) for s in syncs}) == len(syncs)  # the actor moved each step
    last = syncs[-1]["totals"]
    assert last["weight_syncs"] == len(syncs) and last["frozen_rollouts"] == 0
    assert last["verify_steps"] > 0 and last["lean_forward_calls"] > 0  # speculation, lean decode
    assert (tmp_path / "ckpt" / "global_step_3").is_dir()

    resumed_rows = main_ppo(second, args(second, 4))
    assert [r["step"] for r in resumed_rows] == [4]  # resumed, not restarted
    assert _metric(resumed_rows[0], "training/rollout_probs_diff_max") < SYNCED_TOL
    resumed = _syncs(second / "syncs.jsonl")[0]
    assert resumed["copy_checksum"] == pytest.approx(resumed["sent_checksum"], rel=1e-12, abs=1e-9)
    assert resumed["sent_checksum"] == pytest.approx(syncs[-1]["sent_checksum"], rel=1e-6)
    assert resumed["sent_checksum"] != pytest.approx(syncs[0]["sent_checksum"], rel=1e-9)


@pytest.mark.slow  # ~3 min of CI's budget; the EAGLE draft and dppo also run behind verl's agent loop and advantage seams
def test_verl_trainer_eagle_draft_trains_on_the_current_policy(tmp_path: Path) -> None:
    log = tmp_path / "syncs.jsonl"
    extra = [
        *rollout_overrides(sampler="speculative", draft="eagle", sync_log=str(log)),
        *attention_overrides("shared_prefix"),
        *filter_overrides("dppo", {"pruning_rate": 0.5}),
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",  # a normaliser fixed before the draw
    ]
    rows = run(tmp_path, extra, steps=2)
    for row in rows:
        assert _metric(row, "training/rollout_probs_diff_max") < SYNCED_TOL
    # dppo's 1/p weights (a step whose groups are all zero-variance keeps no weighted row)
    assert sum(float(r["data"].get("parts/filter/weighted_rows", 0.0)) for r in rows) > 0
    totals = _syncs(log)[-1]["totals"]
    assert totals["draft_updates"] > 0 and totals["weight_syncs"] >= 2


@pytest.mark.slow  # the control of the sync check (~2.5 min): opt-in, -m slow
def test_verl_trainer_without_syncs_drifts_off_policy(tmp_path: Path) -> None:
    """Control: the same run with the sampler frozen at the checkpoint (explicit opt-in, counted)."""
    log = tmp_path / "syncs.jsonl"
    extra = [
        *rollout_overrides(follow_actor=False, allow_frozen=True, sync_log=str(log)),
        *buffer_overrides(),
    ]
    rows = run(tmp_path, extra, steps=3)
    diffs = [_metric(r, "training/rollout_probs_diff_max") for r in rows]
    assert diffs[0] < SYNCED_TOL  # step 1: the actor has not moved yet
    # two updates later the frozen copy is far behind (synced runs stay ~5e-5 at every step)
    assert diffs[-1] > SYNCED_TOL and diffs[-1] > 20 * diffs[0]
    assert _metric(rows[-1], "parts/sampler/frozen_rollouts") > 0  # counted, never silent


#: zero-variance groups on purpose: every completion of an even-digit prompt scores 1
SOLVED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int(ground_truth) % 2 == 0:
        return 1.0
    text = solution_str.strip()
    return min(len(text), 8) / 8 + sum(c == str(ground_truth) for c in text) / max(1, len(text))
"""


def test_verl_trainer_skips_prompts_and_resumes_their_history(tmp_path: Path) -> None:
    """Prompt skipping through verl's own entry point (``trainer.v1.trainer_mode=grpo_parts_sync``):
    after the first epoch the solved prompts' zero-variance history skips some of them
    (``parts/prompt_skip/prompts_skipped > 0``), every step still rolls out ``train_batch_size``
    prompts; the history is saved beside verl's checkpoint and a resumed run starts from it."""
    from verl_e2e import build_assets, main_ppo, overrides

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    assets = build_assets(tmp_path, n_prompts=8)
    assets["reward"].write_text(SOLVED_REWARD)
    ckpt = tmp_path / "ckpt"

    def args(workdir: Path, steps: int) -> list[str]:
        base = overrides(assets, workdir, steps=steps, batch=4, n=4, response=8)
        base = [a for a in base if not a.startswith(("trainer.save_freq=", "trainer.default_local_dir="))]
        return [*base, *rollout_overrides(), "trainer.use_v1=True", "trainer.v1.trainer_mode=grpo_parts_sync",
                "actor_rollout_ref.model.external_lib=grpo_parts_adapters.verl.plugin",
                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                "+grpo_parts.filter.prompt_skip=history",
                "+grpo_parts.filter.prompt_skip_kwargs.keep_base=0.1",
                "+grpo_parts.filter.prompt_skip_kwargs.base_step=0",
                "trainer.save_freq=4", "trainer.resume_mode=auto", f"trainer.default_local_dir={ckpt}"]  # fmt: skip

    rows = main_ppo(first, args(first, 4))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    drawn = [_metric(r, "parts/prompt_skip/prompts_drawn") for r in rows]
    skipped = [_metric(r, "parts/prompt_skip/prompts_skipped") for r in rows]
    assert drawn[:2] == [4.0, 4.0] and skipped[:2] == [0.0, 0.0]  # epoch 1: no history yet
    assert sum(skipped) > 0  # epoch 2 onwards: solved prompts skipped
    assert all(d - s == 4.0 for d, s in zip(drawn, skipped))  # the step keeps its 4 prompts
    assert (ckpt / "global_step_4" / "grpo_parts_prompt_skip.pt").is_file()

    resumed = main_ppo(second, args(second, 5))
    assert [r["step"] for r in resumed] == [5]
    # the history the first run built (8 prompts), not an empty one (at most this step's prompts)
    assert _metric(resumed[0], "parts/prompt_skip/skip_history_size") >= 8
