"""One training step: the trainer (:mod:`.loop`), its parts (:mod:`.parts`), the optimizer steps a
filled batch is cut into (:mod:`.minibatches`), prompt skipping's draw (:mod:`.prompt_skip`) and what
a step leaves behind (:mod:`.step_record`)."""
