"""/dashboard: a live page of the KV memory, fed by server-sent events at ~2 Hz.

    browser ─GET /dashboard/events─► DashboardHub ─(one producer for every open page)─┐
        ▲                                 every interval_s, only while a page is open: │
        └──── data: {frame JSON} ◄── encode (worker thread) ◄── AsyncEngine.call(take) ◄┘

The engine thread runs ``take`` between two steps (AsyncEngine drains its commands before each
step), and ``take`` only copies the block tables and the cached block ids; the block states, their
run-length encoding and the JSON are built on a worker thread. No page open: no producer, no copy.

The routes sit behind the API key like every API path (server/app.py's _Gate): a browser must
send ``Authorization: Bearer <key>`` itself (a proxy or a header extension) when keys are set.
Any key opens the page, so with several keys (tenants) a frame carries no request's id or block
table, only how many run: one tenant's requests are not another's to see.
The frame's fields are documented in static/dashboard.js, which decodes them.
"""
from __future__ import annotations

import asyncio
import json
import logging
from importlib import resources

import numpy as np
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from kvserve.engine import kv_map
from kvserve.engine.async_engine import EngineSnapshot
from kvserve.server.errors import error_response
from kvserve.server.state import ServerState

log = logging.getLogger(__name__)

MAX_TABLES = 64  # running requests whose block tables a frame carries (the map shows every block)
_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def _asset(name: str) -> bytes:
    return resources.files("kvserve.server").joinpath("static", name).read_bytes()


def _take(engine) -> tuple[kv_map.KVMap, dict | None, str]:
    """Engine thread: the page map's copies, the tiers' counters, the KV format."""
    store = engine.store
    return kv_map.take(engine), (store.snapshot() if store is not None else None), engine.kv_plan.describe()


def _tiers(gpu_hit_rate: float, km: kv_map.KVMap, counts: np.ndarray, store: dict | None) -> list[dict]:
    """Occupancy and hit rate per tier: GPU in blocks held (cached-free ones apart), the others in bytes."""
    out = [{"name": "gpu", "unit": "blocks", "used": int(counts[kv_map.USED] + counts[kv_map.SHARED]),
            "cached": int(counts[kv_map.CACHED]), "capacity": km.num_blocks, "hit_rate": gpu_hit_rate}]
    for name, s in (store or {}).items():
        if not isinstance(s, dict) or "hit_rate" not in s:
            continue  # "load", "cost_model": not tiers
        out.append({"name": name, "unit": "bytes", "used": s.get("used_bytes"), "capacity": s.get("capacity_bytes"),
                    "hit_rate": s["hit_rate"], "hits": s.get("hits", 0), "misses": s.get("misses", 0),
                    "available": s.get("available", True)})
    return out


def build_frame(km: kv_map.KVMap, store: dict | None, kv_format: str, snap: EngineSnapshot,
                prev: EngineSnapshot | None, prev_time: float | None) -> dict:
    """One event's payload. ``prev``/``prev_time``: the last frame's snapshot, for rates over the interval."""
    states = km.states()
    counts = np.bincount(states, minlength=4)
    dt = km.time - prev_time if prev_time is not None else 0.0
    tokens_per_s = gen_per_s = recent_hit = None
    if prev is not None and dt > 0:
        tokens_per_s = (snap.prompt_tokens + snap.generation_tokens - prev.prompt_tokens - prev.generation_tokens) / dt
        gen_per_s = (snap.generation_tokens - prev.generation_tokens) / dt
        q = snap.prefix_cache_queries - prev.prefix_cache_queries
        recent_hit = (snap.prefix_cache_hits - prev.prefix_cache_hits) / q if q > 0 else None
    hit = snap.prefix_cache_hits / snap.prefix_cache_queries if snap.prefix_cache_queries else 0.0
    tables = [{"id": rid, "blocks": len(km.tables.get(rid, ())), "table": kv_map.encode_table(km.tables.get(rid, []))}
              for rid in km.running[:MAX_TABLES]]
    return {
        "time": km.time, "num_blocks": km.num_blocks, "block_size": km.block_size, "kv_format": kv_format,
        "map": kv_map.encode_runs(states), "counts": dict(zip(kv_map.STATE_NAMES, map(int, counts))),
        "running": snap.num_running, "waiting": snap.num_waiting, "num_preemptions": snap.num_preemptions,
        "tokens_per_s": tokens_per_s, "generation_tokens_per_s": gen_per_s,
        "prefix_hit_rate": hit, "prefix_hit_rate_interval": recent_hit,
        "requests": tables, "requests_omitted": max(0, len(km.running) - MAX_TABLES),
        "tiers": _tiers(hit, km, counts, store),
    }


class DashboardHub:
    """Fans one producer's frames out to every open page; each page keeps only the newest frame."""

    def __init__(self, state: ServerState, interval_s: float = 0.5):
        self.state, self.interval_s = state, interval_s
        self._pages: set[asyncio.Queue[bytes]] = set()
        self._producer: asyncio.Task | None = None
        self._prev: tuple[EngineSnapshot, float] | None = None

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    async def events(self):
        q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        self._pages.add(q)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.create_task(self._produce())
        try:
            yield b"retry: 2000\n\n"
            while True:
                yield await q.get()
        finally:
            self._pages.discard(q)

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pages:
            start = loop.time()
            try:
                data = await self._frame()
            except Exception as e:  # noqa: BLE001 - a failed engine shows on the page; the stream stays
                log.debug("dashboard frame failed", exc_info=True)
                data = {"error": f"engine unavailable: {type(e).__name__}"}
            msg = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
            for q in self._pages:
                if q.full():
                    q.get_nowait()
                q.put_nowait(msg)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - start)))

    async def _frame(self) -> dict:
        ae = self.state.engine
        km, store, fmt = await asyncio.wrap_future(ae.call(_take))
        snap = ae.snapshot
        prev, prev_time = self._prev if self._prev is not None else (None, None)
        frame = await asyncio.to_thread(build_frame, km, store, fmt, snap, prev, prev_time)
        frame["waiting"] = ae.num_waiting  # adds not yet drained count as waiting, as in /metrics
        if len(self.state.config.api_keys) > 1:  # any key opens the page: no tenant sees another's requests
            frame["requests"], frame["requests_omitted"] = [], frame["requests_omitted"] + len(frame["requests"])
        self._prev = (snap, km.time)
        return frame


def register(app: FastAPI, state: ServerState) -> DashboardHub:
    hub = app.state.dashboard = DashboardHub(state)
    headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return Response(_asset("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={**headers, "Content-Security-Policy": _CSP})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events():
        return StreamingResponse(hub.events(), media_type="text/event-stream",
                                 headers={**headers, "X-Accel-Buffering": "no"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str):
        if name not in _ASSETS:
            return error_response(404, f"No dashboard asset {name!r}.", code="not_found")
        return Response(_asset(name), media_type=_ASSETS[name], headers=headers)

    return hub
