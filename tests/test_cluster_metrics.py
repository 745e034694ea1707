"""The replicated front end's /metrics and /health (kvserve/cluster/metrics.py, the ingress's
own answers): no Ray, no model. Rendered text is read back with prometheus_client's parser."""
from __future__ import annotations

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cluster.ingress import Ingress
from kvserve.cluster.metrics import render
from kvserve.cluster.reports import ReplicaReports
from kvserve.server.metrics import Metrics

pytestmark = pytest.mark.unit


def _replica_text(seed: int) -> str:
    rng, m = random.Random(seed), Metrics(lambda: None)
    for endpoint in ("chat", "completions"):
        for status in (200, 400, 429):
            for _ in range(rng.randrange(1, 20)):
                m.count(endpoint, status)
    return m.render().decode()


def _by_sample(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_replicas_samples_come_back_labelled():
    reports = {"r1": {"metrics": _replica_text(1), "healthy": True},
               "r2": {"metrics": _replica_text(2), "healthy": False}}
    out = render(reports, {"r1": 5, "r2": 3}, {"r1": 2}, {"prefix_hit": 4, "no_hit": 4})
    text = out.decode()
    fams = list(text_string_to_metric_families(text))
    assert len({f.name for f in fams}) == len(fams)  # one HELP/TYPE per family, replicas merged
    got = _by_sample(text)
    for rid, rep in reports.items():
        own = _by_sample(rep["metrics"])
        assert own and any(v > 0 for v in own.values())
        for (name, labels), value in own.items():
            assert got[(name, tuple(sorted({**dict(labels), "replica": rid}.items())))] == value
    assert got[("kvserve_router_requests_total", (("replica", "r1"),))] == 5
    assert got[("kvserve_router_requests_total", (("replica", "r2"),))] == 3
    assert got[("kvserve_router_in_flight", (("replica", "r1"),))] == 2
    assert got[("kvserve_router_in_flight", (("replica", "r2"),))] == 0
    assert got[("kvserve_router_decisions_total", (("decision", "prefix_hit"),))] == 4
    assert got[("kvserve_router_replicas", (("state", "live"),))] == 2
    assert got[("kvserve_router_replicas", (("state", "healthy"),))] == 1


class _Base:
    def initialize_state(self, **_):
        pass


class _Router(ReplicaReports, _Base):
    def __init__(self, reports: dict[str, dict]):
        class Rid:
            def __init__(self, u):
                self.unique_id = u

        class Replica:
            def __init__(self, stats):
                self.routing_stats = stats

        self.curr_replicas = {Rid(k): Replica(v) for k, v in reports.items()}
        self.initialize_state()


class _Handle:
    def options(self, **_):
        return self


@pytest.mark.parametrize("healthy", [0, 1, 2])
def test_health_counts_replicas(healthy):
    ingress = Ingress(_Handle(), None, None, 16, 1 << 20)
    router = _Router({f"r{i}": {"healthy": i < healthy} for i in range(2)} | {"new": {}})  # "new": no report yet
    r = ingress.health()
    body = json.loads(r.body)
    assert (body["replicas"], body["healthy_replicas"]) == (3, healthy)
    assert r.status_code == (200 if healthy else 503)
    if not healthy:
        assert body["error"]["code"] == "unhealthy"
    del router
