"""Prometheus families of speculative decoding (``--spec-tokens``; issue #14), from the
``spec_*`` keys of ``engine.stats()`` (:meth:`ppstate.scheduler.Scheduler.spec_stats`; summed over
replicas with ``--dp``):

* ``ppstate_spec_proposed_tokens_total`` (counter, tokens): drafts carried by decode rows.
* ``ppstate_spec_accepted_tokens_total`` (counter, tokens): drafts the last rank accepted.
* ``ppstate_spec_decode_rows_total`` (counter, rows): decode rows that carried drafts.
* ``ppstate_spec_acceptance_rate`` (gauge): accepted / proposed, cumulative (0 before any).
* ``ppstate_spec_tokens_per_row`` (gauge, tokens): emitted tokens per decode row with drafts,
  ``1 + accepted / rows`` (1 before any; without speculation every decode row emits 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "ppstate_"


def speculative_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    """The speculative-decoding families of one scrape (nothing when the stats lack them)."""
    if "spec_proposed_tokens" not in s:
        return
    proposed, accepted, rows = (int(s[k]) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                    "spec_decode_rows"))
    yield CounterMetricFamily(PREFIX + "spec_proposed_tokens", "Speculative draft tokens proposed",
                              value=proposed)
    yield CounterMetricFamily(PREFIX + "spec_accepted_tokens", "Speculative draft tokens accepted",
                              value=accepted)
    yield CounterMetricFamily(PREFIX + "spec_decode_rows", "Decode rows that carried drafts",
                              value=rows)
    yield GaugeMetricFamily(PREFIX + "spec_acceptance_rate",
                            "Accepted / proposed draft tokens (cumulative)",
                            value=accepted / proposed if proposed else 0.0)
    yield GaugeMetricFamily(PREFIX + "spec_tokens_per_row",
                            "Tokens emitted per decode row with drafts (1 + accepted / rows)",
                            value=1.0 + accepted / rows if rows else 1.0)
