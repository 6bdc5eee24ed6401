"""What a run writes for people: per-step metrics and summaries (:mod:`.metrics`), ``samples.jsonl``
(:mod:`.samples`), report.md and its plots (:mod:`.report`, :mod:`.report_format`) and the sampler
trace's report (:mod:`.trace_report`)."""
