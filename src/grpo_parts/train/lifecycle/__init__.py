"""A run's lifecycle: loading what the config names (:mod:`.setup`), the run itself (:mod:`.run`),
checkpoints and resuming (:mod:`.checkpoint`, :mod:`.rewind`), stopping on Ctrl-C (:mod:`.interrupt`),
``status.json`` (:mod:`.status`), CPU threads (:mod:`.threads`) and experiment trackers (:mod:`.trackers`)."""
