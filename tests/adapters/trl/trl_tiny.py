"""Tiny, offline GRPOTrainer set-up for the TRL adapter tests: a word-level tokenizer built with
``tokenizers``, a float64 Qwen2 from a config, an in-memory dataset and a deterministic reward."""

from __future__ import annotations

import copy
from typing import Any

import torch
from grpo_parts_adapters.trl import GRPOPartsTrainer

WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {w: 3 + i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def model(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from grpo_parts.tiny import tiny_causal_lm

    return tiny_causal_lm(
        "qwen2", vocab_size=32, hidden_size=32, dtype=dtype, seed=seed, eos_token_id=1, pad_token_id=0
    )


def dataset(n: int = 8) -> Any:
    from datasets import Dataset

    prompts = ["a b c", "d e", "f g h i", "j", "k l m", "n o", "p q r s t", "u v"]
    return Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(n)]})


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Deterministic and spread out: how many vowels, minus a little length."""
    return [sum(w in "aeiou" for w in c.split()) - 0.1 * len(c.split()) for c in completions]


def config(**overrides: Any) -> Any:
    from trl import GRPOConfig

    kw: dict[str, Any] = dict(
        output_dir="/tmp/grpo_parts_trl_tests",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        bf16=False,  # TRL defaults to bf16 autocast on CPU, under which its fused LM head runs in bf16
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


class GradCapture:
    """TrainerCallback that keeps a copy of every gradient right before each optimizer step."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class _Capture(TrainerCallback):
            def __init__(self) -> None:
                self.grads: list[dict[str, torch.Tensor]] = []

            def on_pre_optimizer_step(
                self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
            ) -> None:
                self.grads.append(
                    {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                )

        return _Capture()


def policy_for(base: torch.nn.Module, args: Any) -> torch.nn.Module:
    """``copy.deepcopy(base)``; with ``args.beta != 0`` saved to a temporary folder first, since TRL
    loads the reference model from ``config._name_or_path``."""
    policy = copy.deepcopy(base)
    if args.beta != 0.0:
        import tempfile

        path = tempfile.mkdtemp(prefix="grpo_parts_trl_ref_")
        policy.save_pretrained(path)
        policy.config._name_or_path = path  # type: ignore[union-attr]
    return policy


def build(trainer_cls: Any, base: torch.nn.Module, args: Any, **parts: Any) -> Any:
    """A trainer on ``copy.deepcopy(base)``, not trained."""
    return trainer_cls(
        model=copy.deepcopy(base),
        reward_funcs=reward,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer(),
        **parts,
    )


def run(
    trainer_cls: Any, base: torch.nn.Module, args: Any, n_data: int = 8, make_parts: Any = None, **parts: Any
) -> tuple[Any, Any]:
    """Train ``copy.deepcopy(base)`` with ``trainer_cls``; returns ``(trainer, grad_capture)``.
    ``make_parts(policy) -> dict`` builds parts that need the policy instance (e.g. a sampler)."""
    cap = GradCapture()
    policy = policy_for(base, args)
    trainer = trainer_cls(
        model=policy,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset(n_data),
        processing_class=tokenizer(),
        callbacks=[cap],
        **parts,
        **(make_parts(policy) if make_parts is not None else {}),
    )
    trainer.train()
    return trainer, cap


class Recording(GRPOPartsTrainer):
    """Records the scored batch the filter saw, what TRL trains on, each micro-batch loss and which
    rows the no-grad (old / reference) forwards see."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.scored: list[tuple[dict[str, Any], Any]] = []
        self.trained: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.nograd_rows: list[int] = []

    def _gp_score(self, inputs):  # type: ignore[no-untyped-def]
        out, deferred, scored = super()._gp_score(inputs)
        self.scored.append(({k: v for k, v in out.items()}, scored))
        return out, deferred, scored

    def _get_per_token_logps_and_entropies(self, model, input_ids, *a, **k):  # type: ignore[no-untyped-def]
        if not torch.is_grad_enabled() and not self._gp_deferring:
            self.nograd_rows.append(int(input_ids.shape[0]))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *a, **k)

    def _compute_loss(self, model, inputs):  # type: ignore[no-untyped-def]
        self.trained.append(dict(inputs))
        loss = super()._compute_loss(model, inputs)
        self.losses.append(float(loss.detach()))
        return loss
