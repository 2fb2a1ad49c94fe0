"""Per-replica Prometheus families for ``--dp`` (issue #14).

The unlabelled ``ppstate_*`` engine families stay the totals over all replicas (so a dashboard
built for one pipeline keeps working); these families repeat the per-pipeline figures with a
``replica`` label (``"0"`` .. ``str(dp_size - 1)``), read from ``stats()["replicas"]`` of
:class:`runtime.dp.replicas.ReplicatedEngine` at scrape time:

* ``ppstate_dp_replicas``: number of replicas (gauge).
* ``ppstate_replica_num_requests_running`` / ``..._waiting`` (gauges, requests).
* ``ppstate_replica_engine_steps`` / ``ppstate_replica_generation_tokens`` (counters).
* ``ppstate_replica_rank_busy_seconds`` (counter, labels ``replica``, ``rank``; seconds).
* ``ppstate_replica_pipeline_bubble_fraction`` (gauge, cumulative fraction).
* ``ppstate_replica_kv_cache_blocks_free`` (gauge, blocks), when the replicas report KV stats.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "ppstate_"

#: (stats key, family name without prefix, kind, help)
_PER_REPLICA = (
    ("num_running", "replica_num_requests_running", "gauge", "Requests running, per replica"),
    ("num_waiting", "replica_num_requests_waiting", "gauge", "Requests waiting, per replica"),
    ("steps_total", "replica_engine_steps", "counter", "Scheduling steps executed, per replica"),
    ("generated_tokens_total", "replica_generation_tokens", "counter",
     "Tokens generated, per replica"),
    ("bubble_fraction", "replica_pipeline_bubble_fraction", "gauge",
     "Fraction of rank time idle while work existed (cumulative), per replica"),
    ("kv_blocks_free", "replica_kv_cache_blocks_free", "gauge",
     "KV-cache blocks free or cached-evictable, per replica"),
)


def replica_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The labelled families of one scrape; ``stats`` is ``ReplicatedEngine.stats()``."""
    per: list[dict[str, Any]] = stats["replicas"]
    yield GaugeMetricFamily(PREFIX + "dp_replicas", "Data-parallel replicas (pipelines)",
                            value=len(per))
    for key, name, kind, doc in _PER_REPLICA:
        if key not in per[0]:
            continue
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        fam = cls(PREFIX + name, doc, labels=["replica"])
        for i, s in enumerate(per):
            fam.add_metric([str(i)], float(s[key]))
        yield fam
    busy = CounterMetricFamily(PREFIX + "replica_rank_busy_seconds",
                               "Seconds each pipeline rank spent computing, per replica",
                               labels=["replica", "rank"])
    for i, s in enumerate(per):
        for rank, sec in enumerate(s["rank_busy_seconds"]):
            busy.add_metric([str(i), str(rank)], float(sec))
    yield busy
