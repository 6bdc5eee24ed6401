"""Runs side by side: ``--compare`` (:mod:`.compare`), its arms (:mod:`.arms`), seeds (:mod:`.seeds`),
per-phase breakdowns (:mod:`.phases`) and ablations (:mod:`.ablation`)."""
