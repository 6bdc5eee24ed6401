"""What a run writes for people: metrics and summaries, samples.jsonl, report.md and its plots."""
