"""An engine fault in the middle of a stream reaches the client as an SSE error event in OpenAI's
shape, then `data: [DONE]`; the stream is not just cut, and it is counted once, as a stream error."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx

from kvserve import LLM
from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.app import build_app


def test_fault_mid_stream_sends_error_event_then_done():
    engine = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False).engine
    real, calls = engine.runner.launch, [0]

    def flaky(out):  # a few good steps, then the device "fails" (surfacing when results are read)
        calls[0] += 1
        finish = real(out)
        if calls[0] > 3:
            def fail():
                raise RuntimeError("injected device fault")
            return fail
        return finish
    engine.runner.launch = flaky
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ae = AsyncEngine(engine)
    app = build_app(ae, "tiny")

    async def run():
        ae.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines() if line.startswith("data:")]

    lines = asyncio.run_coroutine_threadsafe(run(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][5:])["error"]
    assert set(err) == {"message", "type", "param", "code"} and "injected device fault" in err["message"]
    assert not ae.healthy
    # counted once, by its outcome: the 200 of its status line is not what happened
    reg = app.state.kvserve.metrics.registry
    assert reg.get_sample_value("kvserve_requests_total", {"endpoint": "completions", "status": "stream_error"}) == 1
    assert reg.get_sample_value("kvserve_requests_total", {"endpoint": "completions", "status": "200"}) is None
