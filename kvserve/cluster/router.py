"""CacheAwareRouter: Ray Serve's pluggable request router, choosing by cached prefix and load.

Ray calls ``choose_replicas`` with the request's arguments; the ingress passes ``route``:

    {"hashes": [block hash, ...],  # chained, of the prompt's full blocks (prefix_index.block_hashes)
     "num_tokens": int,            # the prompt's length
     "session": str | None}        # the caller's session (keyed by its API key), sticky

and tries the ranks it returns in order (Ray skips a replica whose queue is full and tries the
next). ``on_request_routed`` records where it went, ``on_request_completed`` ends its count;
Ray tells us when a replica dies or the set changes, and the index forgets what left.
Replica reports (``EngineReplica.record_routing_stats``): KV size and free fraction, health and
the replica's Prometheus text, which the ingress in this same process reads (``replica_reports``)
to answer /health and /metrics for every live replica; each of our routers registers for that
(reports.py).
"""
from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.experimental.round_robin_router import RoundRobinRouter
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.cluster.prefix_index import Load, PrefixIndex
from kvserve.cluster.reports import ReplicaReports


class RoundRobin(ReplicaReports, RoundRobinRouter):
    """Ray Serve's round robin, registered for /health and /metrics."""


class PowerOfTwo(ReplicaReports, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's power of two choices, registered for /health and /metrics."""


class CacheAwareRouter(ReplicaReports, FIFOMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, **_) -> None:
        super().initialize_state()
        # prefix_hit: sent where part of its prompt was believed cached; no_hit: nowhere was;
        # session: back to its session's replica; fallback: not to the first-ranked replica (it was full)
        self.counts = {"prefix_hit": 0, "no_hit": 0, "session": 0, "fallback": 0}
        self.first_choice: dict[str, ReplicaID] = {}  # internal request id -> its top rank, until routed
        self.index = PrefixIndex(block_size=block_size)
        self.in_flight: dict[ReplicaID, int] = {}
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until it completes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = (pending_request.kwargs.get("route") if pending_request is not None else None) or {}
        loads = {}
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            if "kv_blocks" in stats:
                self.index.set_capacity(r.replica_id, int(stats["kv_blocks"]))
            loads[r.replica_id] = Load(self.in_flight.get(r.replica_id, 0), float(stats.get("kv_free", 1.0)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = self.index.choose(list(by_id), route.get("hashes", ()), route.get("num_tokens", 0), loads,
                                   route.get("session"))
        if pending_request is not None and ranked:
            self.first_choice[pending_request.metadata.internal_request_id] = ranked[0]
            if len(self.first_choice) > 65536:  # requests cancelled before routing never pop theirs
                del self.first_choice[next(iter(self.first_choice))]
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait before trying again
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        route = pending_request.kwargs.get("route") or {}
        first = self.first_choice.pop(pending_request.metadata.internal_request_id, None)
        session = route.get("session")
        if session is not None and self.index.sessions.get(session) == replica_id:
            self.counts["session"] += 1
        elif self.index.matched(replica_id, route.get("hashes", ())):
            self.counts["prefix_hit"] += 1
        else:
            self.counts["no_hit"] += 1
        if first is not None and first != replica_id:
            self.counts["fallback"] += 1
        self.index.record(replica_id, route.get("hashes", ()), route.get("session"))
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.routed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.routed.pop(internal_request_id, None) is not None and self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def decisions(self) -> dict[str, int]:
        return dict(self.counts)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
        self.in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self.index.keep_only(live)
        for rid in [rid for rid in self.in_flight if rid not in live]:
            del self.in_flight[rid]
