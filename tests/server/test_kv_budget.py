"""``kv_budget`` through the official openai client, on dummy:tiny in-process with streaming
eviction on (16-token blocks, max_model_len 64: budgets in [33, 64]): bad values are a 400 in
OpenAI's shape naming the field and the range; null means none; a budgeted request runs beside
others and leaves no block held."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.llm import LLM
from kvserve.server.app import build_app

MODEL = "tiny"


class _TemplateOnly:
    """A chat template over dummy:tiny's ids (the model has no tokenizer)."""
    chat_template = "plain"
    eos_token_id = None

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kwargs):
        return "".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 512 for c in text] or [1]


@pytest.fixture(scope="module")
def srv():
    engine = LLM("dummy:tiny", kv_cache_memory="16MiB", max_model_len=64, max_num_seqs=8, show_progress=False,
                 kv_eviction="streaming").engine
    engine.tokenizer = _TemplateOnly()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ae = AsyncEngine(engine)
    app = build_app(ae, MODEL, on_engine_dead=lambda e: None)

    async def setup():
        ae.start()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        return http, openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
    http, client = asyncio.run_coroutine_threadsafe(setup(), loop).result(60)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)
    yield engine, http, client, run
    assert ae.healthy
    ae.shutdown()
    loop.call_soon_threadsafe(loop.stop)


BAD = [0, 1, 32, 65, 2**31, 2**63, 2**64, -1, 40.5, "40", True, [], {}, "NaN"]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_bad_budget_is_400_naming_the_field(srv, route, value):
    engine, http, _, run = srv
    body = {"model": MODEL, "max_tokens": 4, "kv_budget": value}
    if route == "completions":
        body["prompt"] = [1, 2, 3]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    raw = json.dumps(body).replace('"NaN"', "NaN") if value == "NaN" else json.dumps(body)
    r = run(http.post(f"/v1/{route}", content=raw, headers={"content-type": "application/json"}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_budget" and err["type"] == "invalid_request_error", err
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
        assert "[33, 64]" in err["message"], err


def test_budgets_run_beside_each_other_and_free_everything(srv):
    engine, _, client, run = srv

    async def many():
        kw = dict(model=MODEL, prompt=list(range(3, 40)), max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
        budgets = [33, 48, 64, None]
        outs = await asyncio.gather(*(client.completions.create(**{**kw, "extra_body": {
            "ignore_eos": True, "kv_budget": b}}) for b in budgets))
        return {b: o for b, o in zip(budgets, outs)}
    outs = run(many())
    assert all(o.usage.completion_tokens == 20 for o in outs.values())
    # 37 + 20 = 57 tokens fit a budget of 64: the same greedy output as no budget
    assert outs[64].choices[0].text == outs[None].choices[0].text
    assert engine.kv.pool.num_used_blocks == 0
    null = run(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3,
                                         extra_body={"kv_budget": None}))
    assert null.usage.completion_tokens == 3
