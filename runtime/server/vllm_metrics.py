"""The serving metrics again under vLLM's names and labels, so a vLLM Grafana dashboard works as is.

vLLM's OpenAI server exports ``vllm:``-prefixed series with a ``model_name`` label (the served
model name). This module registers the same names in the app's own registry next to the
``ppstate_*`` series: request histograms fed per request by :class:`VllmRequestMetrics`, and engine
state read from ``engine.stats()`` at scrape time by :class:`VllmEngineCollector`. Definitions
(seconds, tokens):

* TTFT: request arrival in the server -> first output token (as ``ppstate_time_to_first_token``).
* ITL (``inter_token_latency``, and the older ``time_per_output_token`` name dashboards still use):
  gap between consecutive streamed increments.
* ``request_time_per_output_token``: per request, (last - first token) / (output tokens - 1).
* ``e2e_request_latency``: arrival -> last increment.
* ``request_queue_time``: the engine's arrival -> the step that first scheduled the request.
* ``request_prefill_time``: first scheduled -> first token; ``request_decode_time``: first ->
  last token; ``request_inference_time``: first scheduled -> last token.
* ``kv_cache_usage_perc`` (and the older ``gpu_cache_usage_perc``): 1 - free / total KV blocks
  (cached but evictable blocks count as free), in [0, 1].
* prefix-cache queries / hits in prompt tokens (also under the older ``gpu_prefix_cache_*``).

The full list is :data:`VLLM_SERIES` (docs/server.md lists them too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

V = "vllm:"
LABEL = "model_name"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)

#: every vLLM series this server exports: (name as exposed, Prometheus type)
VLLM_SERIES: tuple[tuple[str, str], ...] = (
    ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:gpu_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries_total", "counter"), ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:gpu_prefix_cache_queries_total", "counter"), ("vllm:gpu_prefix_cache_hits_total", "counter"),
    ("vllm:num_preemptions_total", "counter"), ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"), ("vllm:request_success_total", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:time_per_output_token_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_prompt_tokens", "histogram"), ("vllm:request_generation_tokens", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
)


class VllmEngineCollector(Collector):
    """Scheduler and KV-cache state under vLLM's names, read from ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(V + name, doc, labels=[LABEL])
        g.add_metric([self._model], float(value))
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(V + name, doc, labels=[LABEL])
        c.add_metric([self._model], float(value))
        return c

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:  # a dead engine may not answer; /metrics must still render
            return
        yield self._gauge("num_requests_running", "Requests in model execution batches",
                          s["num_running"])
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled", s["num_waiting"])
        yield self._counter("generation_tokens", "Generation tokens processed",
                            s["generated_tokens_total"])
        if "kv_blocks_total" in s:
            total = max(1, int(s["kv_blocks_total"]))
            usage = 1.0 - float(s["kv_blocks_free"]) / total
            yield self._gauge("kv_cache_usage_perc", "KV-cache usage, 1 = 100 percent", usage)
            yield self._gauge("gpu_cache_usage_perc", "KV-cache usage, 1 = 100 percent (older name)",
                              usage)
            for prefix in ("", "gpu_"):
                yield self._counter(prefix + "prefix_cache_queries", "Prefix-cache queries, in tokens",
                                    s["prefix_cache_query_tokens"])
                yield self._counter(prefix + "prefix_cache_hits", "Prefix-cache hits, in tokens",
                                    s["prefix_cache_hit_tokens"])
            yield self._counter("num_preemptions", "Cumulative preemptions", s["num_preemptions"])


class VllmRequestMetrics:
    """The per-request vLLM series of one app (histograms and counters, ``model_name`` label)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 stats: Callable[[], dict[str, Any]]) -> None:
        def hist(name: str, doc: str, buckets) -> Any:
            return Histogram(V + name, doc, [LABEL], buckets=buckets, registry=registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency (s)", ITL_BUCKETS)
        self.tpot_old = hist("time_per_output_token_seconds",
                             "Inter-token latency (s; the older name)", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Time per output token after the first, per request (s)", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency (s)",
                        LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time in the waiting queue (s)",
                          LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time in the prefill phase (s)",
                            LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time in the decode phase (s)",
                           LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Prefill + decode time (s)",
                              LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        self.max_tokens = hist("request_params_max_tokens", "max_tokens per request", TOKEN_BUCKETS)
        self.prompt_tokens = Counter(V + "prompt_tokens", "Prefill tokens processed", [LABEL],
                                     registry=registry).labels(model_name)
        self._success = Counter(V + "request_success", "Finished requests by finish reason",
                                [LABEL, "finished_reason"], registry=registry)
        self._model = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        registry.register(VllmEngineCollector(stats, model_name))

    def admitted(self, prompt_tokens: int, max_tokens: int) -> None:
        """A request entered the engine."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_len.observe(prompt_tokens)
        self.max_tokens.observe(max_tokens)

    def finished(self, reason: str, num_output_tokens: int) -> None:
        """A request ended (``stop``, ``length`` or ``abort``)."""
        self._success.labels(self._model, reason).inc()
        self.gen_len.observe(num_output_tokens)

    def phases(self, scheduled_s: float | None, first_s: float | None, last_s: float) -> None:
        """Prefill / decode / inference times of a finished request (``time.monotonic`` stamps:
        first scheduled, first token, last token; a request never scheduled records none)."""
        if scheduled_s is None:
            return
        self.inference.observe(max(0.0, last_s - scheduled_s))
        if first_s is not None:
            self.prefill.observe(max(0.0, first_s - scheduled_s))
            self.decode.observe(max(0.0, last_s - first_s))
