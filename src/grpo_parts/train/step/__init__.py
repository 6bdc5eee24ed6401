"""One training step: the trainer, its parts, its minibatches, prompt skipping's draw, its record."""
