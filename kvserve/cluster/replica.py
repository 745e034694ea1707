"""EngineReplica: one kvserve engine and the single-process server's app, as a Ray Serve replica.

The app is the one `kvserve serve` runs (server/app.py: auth, limits, validation, errors,
streaming), driven here over ASGI without a socket. ``handle`` yields the response as it comes:

    {"status", "headers", "replica"}   once, when the app starts its response
    bytes, bytes, ...                  its body, one item per ASGI body message (one SSE event)

so a stream reaches the client event by event. If the caller goes away (the client left, or Ray
cancels the call), the app sees ``http.disconnect`` and aborts the engine request.

``record_routing_stats`` (called by Ray every second) tells the router how full this replica
is, and the ingress whether it is healthy and its Prometheus metrics; ``check_health`` fails
once the engine has failed for good, so Ray replaces it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.app import build_app
from kvserve.server.launcher import app_kwargs


class EngineReplica:
    async def __init__(self, args, make_engine):
        from ray import serve
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(make_engine(args))
        self.app = build_app(self.engine, **app_kwargs(args))
        self.engine.start()  # build_app's lifespan would; this app runs without one

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                     body: bytes, route: dict | None = None) -> AsyncIterator[dict | bytes]:
        """One HTTP request through the app. ``route`` is for the router (router.py), unused here."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        sent, gone = [False], asyncio.Event()
        out: asyncio.Queue = asyncio.Queue()

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            out.put_nowait(msg)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while (msg := await out.get()) is not None:
                if msg["type"] == "http.response.start":
                    yield {"status": msg["status"], "headers": msg.get("headers", []), "replica": self.replica_id}
                elif msg["type"] == "http.response.body" and msg.get("body"):
                    yield msg["body"]
            task.result()  # the app's own failure (it answers errors itself; this is a bug)
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait({task}, timeout=5.0)

    def record_routing_stats(self) -> dict:
        snap = self.engine.snapshot
        blocks = snap.kv_blocks_used + snap.kv_blocks_free
        return {"kv_blocks": blocks, "kv_free": snap.kv_blocks_free / blocks if blocks else 1.0,
                "waiting": self.engine.num_waiting, "running": snap.num_running,
                "prefix_cache_queries": snap.prefix_cache_queries, "prefix_cache_hits": snap.prefix_cache_hits,
                "healthy": self.engine.healthy, "metrics": self.app.state.kvserve.metrics.render().decode()}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError(f"the engine stopped: {self.engine.error!r}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
