"""What every framework door (TRL, verl, OpenRLHF) needs, decided once below the adapters; each
adapter calls these and adds only its framework's translation.

* :mod:`.skipping` -- the prompt-skip stage's skipper, built and refused in one line where the door's
  loss cannot stay unbiased (the stage itself, which weighs and observes: :mod:`grpo_parts.skip.stage`);
* :mod:`.weights` -- a weighted filter's (``dppo``) row weights: ``1 / p x kept / rolled-out rows``;
* :mod:`.agreement` -- the step after a shared-prefix plan: fall back to the framework's own forward
  on every rank together, and agree on the number of model calls;
* :mod:`.grouping` / :mod:`.serving` -- one-completion requests regrouped into a sampler's prompt
  groups and answered in batches, one sampler call each;
* :mod:`.policy_copy` -- a rollout process's copy of the policy, kept equal to the trained one.

Every counter a door logs is named in :mod:`grpo_parts.counters`, which also counts the calls of
each part (:class:`~grpo_parts.counters.PartCounters`). Framework-free: nothing here imports TRL,
verl or OpenRLHF, and nothing below :mod:`grpo_parts.build` imports this package.
"""
