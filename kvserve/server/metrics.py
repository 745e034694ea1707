"""Prometheus metrics: request outcomes and latencies (observed by the server), engine state
(read from AsyncEngine.snapshot at scrape time). One registry per app, so tests can build several."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from kvserve.engine.async_engine import AsyncEngine
from kvserve.outputs import RequestOutput

disable_created_metrics()  # the *_created series only add noise to every scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class _EngineCollector:
    """Engine gauges at scrape time; while the model loads (no engine yet) only `healthy` = 0."""

    def __init__(self, get_engine: Callable[[], AsyncEngine | None]):
        self.get_engine = get_engine

    def collect(self):
        e = self.get_engine()
        if e is None:
            g = GaugeMetricFamily("kvserve_engine_healthy", "1 while the engine loop runs without a fault")
            g.add_metric([], 0.0)
            yield g
            return
        s = e.snapshot
        gauges = [
            ("kvserve_num_requests_running", "requests in the running batch", s.num_running),
            ("kvserve_num_requests_waiting", "requests queued, not yet scheduled", e.num_waiting),
            ("kvserve_kv_blocks_used", "KV blocks referenced by live requests", s.kv_blocks_used),
            ("kvserve_kv_blocks_free", "KV blocks free (cached-but-unreferenced included)", s.kv_blocks_free),
            ("kvserve_kv_blocks_cached", "KV blocks holding a reusable prefix", s.kv_blocks_cached),
            ("kvserve_kv_blocks_pinned", "KV blocks held by pinned prefixes", s.kv_blocks_pinned),
            ("kvserve_prefix_cache_hit_rate", "prefix-cache hits over prompt tokens looked up", s.prefix_hit_rate),
            ("kvserve_kv_waste", "allocated KV slots not holding a token, last step", s.kv_waste),
            ("kvserve_engine_healthy", "1 while the engine loop runs without a fault", 1.0 if e.healthy else 0.0),
        ]
        for name, doc, v in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], v)
            yield g
        counters = [
            ("kvserve_num_preemptions", "requests preempted", s.num_preemptions),
            ("kvserve_prompt_tokens", "prompt tokens computed (prefix-cache hits excluded)", s.prompt_tokens),
            ("kvserve_generation_tokens", "tokens generated", s.generation_tokens),
            ("kvserve_engine_errors", "faults in the engine loop", 0 if e.error is None else 1),
            ("kvserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("kvserve_prefix_cache_hits", "prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ]
        for name, doc, v in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], v)
            yield c
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode)
        if getattr(e.engine, "kv_policy", None) is not None:
            yield from _kv_policy_metrics(e.engine.kv_policy)


def _kv_policy_metrics(c):
    """The KV levers the engine runs with (``engine/kv_policy.py``): chosen by ``kv_policy``
    auto, or as configured (reason "configured")."""
    info = InfoMetricFamily("kvserve_kv_policy", "KV cache levers in use: chosen by kv_policy auto, or configured")
    info.add_metric([], {"kv_policy": c.policy, "kv_cache_dtype": c.kv_format, "window_kv": c.window_kv,
                         "kv_eviction": c.kv_eviction, "kv_tiers": "on" if c.tiers else "off",
                         "kv_quality_floor": c.quality_floor, "reason": c.reason})
    yield info
    for name, doc, v in (("kv_policy_fits_sequences", "max_model_len sequences the KV pool holds at once",
                          c.fits_sequences),
                         ("kv_policy_target_sequences", "max_model_len sequences kv_policy auto aims to hold",
                          c.target_sequences),
                         ("kv_policy_share_tokens", "kv_budget kv_policy auto gives a request that may pass it "
                          "(kv_quality_floor eviction; 0: none)", c.share or 0)):
        g = GaugeMetricFamily(f"kvserve_{name}", doc)
        g.add_metric([], v)
        yield g


def _spec_decode_metrics(sp):
    """Speculative decoding, with vLLM's names (under kvserve_)."""
    for name, doc in (("spec_decode_num_drafts", "verify steps of a request with drafts"),
                      ("spec_decode_num_draft_tokens", "draft tokens proposed"),
                      ("spec_decode_num_accepted_tokens", "draft tokens accepted")):
        c = CounterMetricFamily(f"kvserve_{name}", doc)
        c.add_metric([], getattr(sp, name))
        yield c
    c = CounterMetricFamily("kvserve_spec_decode_num_accepted_tokens_per_pos",
                            "draft tokens accepted, by position in the step's drafts", labels=["position"])
    for j, v in enumerate(sp.spec_decode_num_accepted_tokens_per_pos):
        c.add_metric([str(j)], v)
    yield c
    g = GaugeMetricFamily("kvserve_spec_decode_mean_acceptance_length",
                          "tokens a verify step emits on average (accepted drafts + 1)")
    g.add_metric([], sp.mean_acceptance_length)
    yield g


class Metrics:
    def __init__(self, get_engine: Callable[[], AsyncEngine | None]):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_requests", "HTTP API requests by endpoint and outcome",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds", "decode time per token after the first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(get_engine))

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
            n = max(len(c.token_ids) for c in out.outputs)
            if n > 1 and m.first_token_time is not None and m.finished_time is not None:
                self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
