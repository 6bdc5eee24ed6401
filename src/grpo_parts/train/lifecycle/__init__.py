"""A run's lifecycle: set-up, the run, checkpoints and rewinds, signals, status.json, threads, trackers."""
