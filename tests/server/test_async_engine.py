"""AsyncEngine in-process on dummy:tiny: outputs stream in order, validation raises at add time,
cancelling frees KV, and a fault in step() fails every waiter (500 through the app) and /health."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app


@pytest.fixture(params=[None, True], ids=["device-default", "async-scheduling"])
def engine(request):
    """Both schedulings: the CPU's default (synchronous) and async, CUDA's default, which CI
    could not otherwise run the server on."""
    return LLMEngine(EngineConfig(model="dummy:tiny", cache=CacheConfig(kv_cache_memory=16 << 20),
                                  show_progress=False, async_scheduling=request.param))


def test_stream_validate_cancel(engine):
    async def run():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            p = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
            outs = [o async for o in ae.generate("a", [1, 2, 3], p)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
            assert all(len(x.outputs[0].token_ids) < len(y.outputs[0].token_ids) for x, y in zip(outs, outs[1:]))
            with pytest.raises(InvalidRequestError) as e:
                ae.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4000))
            assert e.value.field == "max_tokens"
            long = SamplingParams(max_tokens=2000, ignore_eos=True)
            gen = ae.generate("d", [4, 5], long)
            await anext(gen)
            await anext(gen)
            assert ae.snapshot.kv_blocks_used > 0
            await gen.aclose()
            for _ in range(100):
                if ae.snapshot.kv_blocks_used == 0 and ae.snapshot.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert ae.snapshot.kv_blocks_used == 0 and ae.snapshot.num_running == 0
        finally:
            ae.shutdown()
    asyncio.run(run())


def test_step_fault_fails_waiters_and_health(engine):
    def boom():
        raise RuntimeError("simulated device fault")

    async def run():
        ae = AsyncEngine(engine)
        app = build_app(ae, "tiny")
        ae.start()
        try:
            engine.step = boom
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2],
                                                                            "max_tokens": 4}) for _ in range(3)])
                assert [r.status_code for r in rs] == [500] * 3
                assert all("simulated device fault" in r.json()["error"]["message"] for r in rs)
                assert (await c.get("/health")).status_code == 503
                assert "kvserve_engine_healthy 0.0" in (await c.get("/metrics")).text
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1})
                assert r.status_code == 500  # refused at once, not hung
            with pytest.raises(EngineDeadError):
                ae.add_request("z", [1], SamplingParams())
        finally:
            ae.shutdown()
    asyncio.run(asyncio.wait_for(run(), 30))


def test_shutdown_aborts_requests_in_flight(engine):
    """Shutting down with requests still running aborts them all: no group, no KV block and no
    output state is left behind, and the engine thread ends cleanly."""
    async def run():
        ae = AsyncEngine(engine)
        ae.start()
        long = SamplingParams(max_tokens=2000, ignore_eos=True)
        gens = [ae.generate(f"r{i}", [1 + i, 2, 3], long) for i in range(3)]
        for g in gens:
            await anext(g)
        assert engine.kv.pool.num_used_blocks > 0
        ae.shutdown()
        assert not ae._thread.is_alive()
        for g in gens:
            with pytest.raises(EngineDeadError):
                async for _ in g:
                    pass
    asyncio.run(run())
    assert not engine.scheduler.groups and not engine.output_processor.groups
    assert engine.kv.pool.num_used_blocks == 0
    engine.check_invariants()
