"""Runs side by side: ``--compare``, its arms and seeds, per-phase breakdowns and ablations."""
