"""The routers of this process, for the ingress: what each live replica last reported.

Ray builds the handle's router in the handle's process (the ingress) from a copy of router.py
pickled by value, whose module globals are copies too; so the registry lives here, in a module
Ray imports by name, where the ingress finds the same one.
"""
from __future__ import annotations

import weakref

# The routers living in this process (Ray builds one per deployment handle, in the handle's
# process: the ingress). Weak, so a router Ray drops leaves.
_LIVE: weakref.WeakSet = weakref.WeakSet()


class ReplicaReports:
    """Registers the router so that the ingress can read its live replicas' last reports."""

    def initialize_state(self, **kwargs) -> None:
        _LIVE.add(self)
        super().initialize_state(**kwargs)

    def reports(self) -> dict[str, dict]:
        """Replica id -> its last ``record_routing_stats`` ({} before its first), for every live replica."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in list(self.curr_replicas.items())}

    def decisions(self) -> dict[str, int]:
        """Counts of routing decisions by kind, for /metrics (none for a router without its own)."""
        return {}


def replica_reports() -> tuple[dict[str, dict], dict[str, int]] | None:
    """(reports per live replica, decision counts) from this process's router; None before Ray built one."""
    routers = list(_LIVE)
    if not routers:
        return None
    r = routers[-1] if len(routers) == 1 else max(routers, key=lambda x: len(x.curr_replicas))
    return r.reports(), r.decisions()
