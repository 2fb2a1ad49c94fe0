"""Record and replay of runs: event models, run directories, codec, replay, timeline
(``docs/trace_format.md``)."""
