"""The dropped-row counters on /metrics (issue #27): per-rank deferred rows dropped by the
generation check and rows the scheduler discarded, rendered from ``engine.stats()``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.server.metrics import EngineCollector


def test_dropped_and_discarded_rows_exported_per_rank():
    stats = {"num_running": 1, "num_waiting": 0, "pp_size": 3, "steps_total": 10,
             "generated_tokens_total": 9, "rank_busy_seconds": [0.1, 0.2, 0.3],
             "bubble_fraction": 0.1, "dropped_deferred_rows": [4, 2, 0],
             "discarded_result_rows": 5}
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(lambda: stats, lambda: True))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode())
               for s in fam.samples}
    assert [samples[("ppstate_dropped_deferred_rows_total", (("rank", str(r)),))]
            for r in range(3)] == [4, 2, 0]
    assert samples[("ppstate_discarded_result_rows_total", ())] == 5
