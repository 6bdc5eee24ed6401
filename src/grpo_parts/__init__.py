"""grpo_parts: drop-in, proven-equivalent accelerators for GRPO training.

Five parts, each behind a typed Protocol with a plain reference implementation:

* ``grpo_parts.sampler``   -- ``Sampler``          (reference: batched KV-cache sampling)
* ``grpo_parts.draft``     -- ``DraftModel``       (reference: frozen small causal LM)
* ``grpo_parts.attention`` -- ``AttentionBackend`` (reference: repeated-prefix forward)
* ``grpo_parts.filter``    -- ``CompletionFilter`` (reference: keep every completion)
* ``grpo_parts.skip``      -- ``PromptSkipper``    (reference: roll out every prompt)

The GRPO maths every part and adapter shares lives in ``grpo_parts.core``.
Importing this package imports nothing heavy and has no side effects.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
