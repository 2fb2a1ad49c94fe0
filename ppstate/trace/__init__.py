"""The trace format of recorded runs (``docs/trace_format.md``): event models, run directories
and the codec of the core's dataclasses. Written by the runtime, the simulator and the model
checker, read by the replayer (:mod:`ppstate.replay`)."""
