"""/metrics of a replicated kvserve: every live replica's metrics with a ``replica`` label, and the
front end's own.

Each replica sends its Prometheus text with its routing report (replica.py, every second), so a
scrape costs no call to the replicas and shows each as of its last report. The texts are parsed
with prometheus_client's parser, each sample given ``replica="<id>"``, families of one name from
several replicas merged into one (one HELP/TYPE), and rendered again by prometheus_client.

The front end's own families:

    kvserve_router_requests_total{replica}      requests a replica started answering
    kvserve_router_in_flight{replica}           of those, not yet finished
    kvserve_router_decisions_total{decision}    the cache-aware router's choices (router.py)
    kvserve_router_replicas{state}              live replicas, and of those the healthy
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def replica_families(reports: dict[str, dict]) -> list[Metric]:
    """The replicas' metric families, merged by name, every sample labelled with its replica."""
    merged: dict[str, Metric] = {}
    for rid in sorted(reports):
        for fam in text_string_to_metric_families(reports[rid].get("metrics", "")):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [Sample(s.name, {**s.labels, "replica": rid}, s.value, s.timestamp, s.exemplar)
                            for s in fam.samples]
    return list(merged.values())


class _Collector:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def render(reports: dict[str, dict], routed: dict[str, int], in_flight: dict[str, int],
           decisions: dict[str, int]) -> bytes:
    requests = CounterMetricFamily("kvserve_router_requests", "Requests a replica started answering, "
                                   "by replica.", labels=["replica"])
    busy = GaugeMetricFamily("kvserve_router_in_flight", "Requests a replica is answering now, by replica.",
                             labels=["replica"])
    for rid in sorted(set(routed) | set(reports)):
        requests.add_metric([rid], routed.get(rid, 0))
        busy.add_metric([rid], in_flight.get(rid, 0))
    decided = CounterMetricFamily("kvserve_router_decisions", "The cache-aware router's decisions: prefix_hit, "
                                  "no_hit, session, fallback (not its first choice).", labels=["decision"])
    for kind, n in sorted(decisions.items()):
        decided.add_metric([kind], n)
    replicas = GaugeMetricFamily("kvserve_router_replicas", "Live replicas (state=live), and of those the "
                                 "healthy (state=healthy).", labels=["state"])
    replicas.add_metric(["live"], len(reports))
    replicas.add_metric(["healthy"], sum(1 for r in reports.values() if r.get("healthy")))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector([requests, busy, decided, replicas, *replica_families(reports)]))
    return generate_latest(registry)
