"""Sampling on the last pipeline stage: from a step's logits to its tokens and logprobs.

Modules, each importing only those listed before it (one way, no cycle):

* :mod:`~runtime.sampling.step_logprobs` -- ``StepLogprobs``, the sampled tokens' logprobs as
  arrays (numpy only; the wire and the engine read it);
* :mod:`~runtime.sampling.batch` -- ``SamplingBatch``, one step's sampling parameters on the
  device, built per row from ``SamplingParams`` (the engine builds a one-row batch for every request
  before admitting it), and ``seeded_uniform``;
* :mod:`~runtime.sampling.penalties` -- repetition / presence / frequency penalties over the
  slots' token history;
* :mod:`~runtime.sampling.sampler` -- ``sample``: greedy, temperature, top-k, top-p, logprobs;
* :mod:`~runtime.sampling.sampling_state` -- every slot's parameters as device tables, gathered
  per step into a ``SamplingBatch`` (owned by the worker's ``DeviceState``);
* :mod:`~runtime.sampling.speculative_verify` -- speculative decoding's drafts and the last rank's verify.

Nothing here imports :mod:`runtime.worker` or :mod:`runtime.engine`; the worker and the engine
import this package. Importing the package itself imports nothing (no torch).
"""
