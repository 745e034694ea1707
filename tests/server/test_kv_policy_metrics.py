"""What the KV policy is, where an operator and a client can see it: ``/metrics`` carries
``kvserve_kv_policy_info`` (format, window freeing, eviction, tiers, quality floor, reason) for an engine whose
levers ``kv_policy="auto"`` chose and for one run as configured; each ``RequestOutput.metrics``
names the format, eviction and budget its request ran under. On dummy:tiny (512 bytes of fp32 KV
per token), max_model_len 256: 512KiB of KV holds 8 sequences only in int8
(``tests/test_kv_policy.py``), 4MiB holds them in fp32."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.outputs import RequestKVPolicy
from kvserve.server.app import build_app


def scrape(engine) -> dict:
    """The /metrics text of an app over ``engine``, parsed: sample name -> list of (labels, value)."""
    app = build_app(AsyncEngine(engine), "tiny", on_engine_dead=lambda e: None)

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.get("/metrics")
    r = asyncio.run(get())
    assert r.status_code == 200, r.text
    samples: dict = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def policy_labels(samples: dict) -> dict:
    [(labels, value)] = samples["kvserve_kv_policy_info"]
    assert value == 1.0
    return labels


def tiny(memory: str, **kw) -> LLM:
    return LLM("dummy:tiny", kv_cache_memory=memory, max_model_len=256, show_progress=False, **kw)


@pytest.mark.parametrize("memory,fmt", [("512KiB", "int8"), ("4MiB", "float32")])
def test_metrics_show_what_auto_chose(memory, fmt):
    llm = tiny(memory, kv_policy="auto")
    samples = scrape(llm.engine)
    labels = policy_labels(samples)
    assert labels["kv_policy"] == "auto"
    assert labels["kv_cache_dtype"] == fmt
    # the label is the format the pool was built in, not only what the choice said
    assert llm.engine.runner.kv_format.name == ("auto" if fmt == "float32" else fmt)
    assert labels["kv_eviction"] == "none" and labels["kv_tiers"] == "off"
    assert labels["window_kv"] == llm.config.cache.window_kv
    [(_, fits)] = samples["kvserve_kv_policy_fits_sequences"]
    [(_, target)] = samples["kvserve_kv_policy_target_sequences"]
    assert target == 8 and fits >= 8
    assert f"KV in {'the model dtype' if fmt == 'float32' else fmt}: the pool holds {int(fits)} sequences " \
           "of 256 tokens (target 8)" in labels["reason"]
    assert llm.engine.kv.pool.num_blocks * llm.config.cache.block_size >= fits * 256


def test_metrics_show_eviction_kept_in_the_model_dtype():
    labels = policy_labels(scrape(tiny("512KiB", kv_policy="auto", kv_eviction="streaming").engine))
    assert (labels["kv_cache_dtype"], labels["kv_eviction"]) == ("float32", "streaming")
    assert "kv_eviction streaming needs the model dtype" in labels["reason"]


def test_metrics_show_configured_levers():
    llm = tiny("512KiB", kv_cache_dtype="int4", kv_eviction="none")
    labels = policy_labels(scrape(llm.engine))
    assert labels == {"kv_policy": "manual", "kv_cache_dtype": "int4", "window_kv": llm.config.cache.window_kv,
                      "kv_eviction": "none", "kv_tiers": "off", "kv_quality_floor": "int4", "reason": "configured"}
    labels = policy_labels(scrape(tiny("1MiB", kv_eviction="h2o").engine))
    assert (labels["kv_cache_dtype"], labels["kv_eviction"], labels["reason"]) == ("float32", "h2o", "configured")


def test_request_metrics_name_the_policy_it_ran_under():
    llm = tiny("1MiB", kv_eviction="streaming")
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, kv_budget=b) for b in (48, None)]
    budgeted, plain = llm.generate([{"prompt_token_ids": list(range(1, 101))}] * 2, params, use_tqdm=False)
    assert budgeted.metrics.kv_policy == RequestKVPolicy("float32", "streaming", 48, "the request's kv_budget")
    assert plain.metrics.kv_policy == RequestKVPolicy("float32", "none", None)
    out = tiny("512KiB", kv_policy="auto").generate([{"prompt_token_ids": [5, 6, 7]}],
                                                    SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.metrics.kv_policy == RequestKVPolicy("int8", "none", None)


def test_metrics_show_the_quality_floor_and_the_share():
    """At kv_quality_floor eviction, a pool short of the target: /metrics names the floor, the
    eviction chosen, and the share a long request is given as its budget."""
    llm = tiny("256KiB", kv_policy="auto", kv_quality_floor="eviction")
    samples = scrape(llm.engine)
    labels = policy_labels(samples)
    assert (labels["kv_quality_floor"], labels["kv_eviction"], labels["kv_cache_dtype"]) == (
        "eviction", "streaming", "float32")
    [(_, share)] = samples["kvserve_kv_policy_share_tokens"]
    assert share == llm.engine.kv_policy.share == llm.engine.kv.pool.num_blocks * llm.config.cache.block_size // 8
    [(_, share)] = scrape(tiny("4MiB", kv_policy="auto", kv_quality_floor="eviction").engine)[
        "kvserve_kv_policy_share_tokens"]
    assert share == 0  # the target fits: no request is given a budget
