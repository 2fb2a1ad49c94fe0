"""Prometheus families of the pipeline's safety net for deferred rows (issue #27), from
``engine.stats()``:

* ``ppstate_dropped_deferred_rows_total{rank}`` (counter, rows): deferred sampled rows a non-last
  rank's PPHandler dropped by the slot-generation check, because the slot was freed (finished,
  aborted) or preempted after the step was issued (``EngineCounters.dropped_rows``; 0 on the last
  rank, which applies its rows at once).
* ``ppstate_discarded_result_rows_total`` (counter, rows): rows the last rank sampled and applied
  to a slot whose request had left it by the time the result arrived; the scheduler drops them
  (``Scheduler.num_discarded_rows``).

Both count how often the protocol's stale-row rules fired; neither is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

PREFIX = "ppstate_"


def mirror_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    """The dropped-row families of one scrape (nothing when the stats lack them)."""
    if "dropped_deferred_rows" in s:
        fam = CounterMetricFamily(PREFIX + "dropped_deferred_rows",
                                  "Deferred sampled rows dropped as stale by the slot-generation "
                                  "check, per rank", labels=["rank"])
        for rank, n in enumerate(s["dropped_deferred_rows"]):
            fam.add_metric([str(rank)], float(n))
        yield fam
    if "discarded_result_rows" in s:
        yield CounterMetricFamily(PREFIX + "discarded_result_rows",
                                  "Sampled rows whose request had left its slot (dropped by the "
                                  "scheduler)", value=s["discarded_result_rows"])
