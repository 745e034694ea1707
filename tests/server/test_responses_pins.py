"""Responses `instructions` pinned in the prefix cache, through the official openai client on
dummy:tiny with a byte-level tokenizer and a pool of a few dozen blocks: after enough unrelated
traffic to fill the pool several times, a request with the same instructions still reports
cached tokens while the same-sized system prompt sent through chat (not pinned) is evicted; the
pin shows in /metrics, is another tenant's hit never (key isolation), and goes, leaving every
block free, once the responses holding it are deleted."""
from __future__ import annotations

import random
import re
import time

import openai
import pytest
from byte_tokenizer import build
from fastapi.testclient import TestClient

from kvserve.llm import LLM
from kvserve.server.app import build_app

A, B = "key-of-tenant-a", "key-of-tenant-b"
MODEL = "tiny"
INSTRUCTIONS = "You answer in one short sentence, politely, and never mention the weather at all."
OTHER = "You reply with a single word, in capitals, and never use any punctuation in replies."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok_dir = build(str(tmp_path_factory.mktemp("byte_tokenizer")))
    engines = []

    def load():
        engines.append(LLM("dummy:tiny", tokenizer=tok_dir, kv_cache_memory="640KiB", block_size=16,
                           max_model_len=512, max_pinned_fraction=0.25, show_progress=False).engine)
        return engines[0]
    with TestClient(build_app(load, MODEL, api_key=[A, B], prefix_cache_isolation="key",
                              metrics_public=True)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        yield c, c.app.state.kvserve.engine


def _client(c, key=A) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=c, max_retries=0)


def _on_engine(engine, fn):
    return engine.call(fn).result(timeout=30)


def _pinned_metric(c) -> float:
    m = re.search(r"^kvserve_kv_blocks_pinned (\S+)$", c.get("/metrics").text, re.M)
    return float(m.group(1))


def _pressure(cl, seed: int, num_blocks: int) -> None:
    """Unrelated chat requests filling the pool three times over."""
    rng = random.Random(seed)
    for _ in range(num_blocks * 16 * 3 // 300 + 1):
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(300))
        cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1)


def _chat_cached(cl, system: str, user: str) -> int:
    r = cl.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "system", "content": system},
                                                                      {"role": "user", "content": user}])
    return r.usage.prompt_tokens_details.cached_tokens


def test_instructions_stay_cached_under_pressure_until_deleted(served):
    c, engine = served
    cl, kw = _client(c), dict(model=MODEL, max_output_tokens=2, temperature=0)
    num_blocks, budget = _on_engine(engine, lambda e: (e.num_kv_blocks, e.pins.max_blocks))
    r1 = cl.responses.create(input="Hi there.", instructions=INSTRUCTIONS, **kw)
    assert _chat_cached(cl, OTHER, "Hi there.") == 0  # the same shape, unpinned
    pinned = _on_engine(engine, lambda e: e.pins.num_blocks)
    assert 0 < pinned <= budget
    assert _pinned_metric(c) == pinned
    _pressure(cl, 1, num_blocks)
    r2 = cl.responses.create(input="What is a fox?", instructions=INSTRUCTIONS, **kw)
    assert r2.usage.input_tokens_details.cached_tokens >= pinned * 16 > 0
    r3 = cl.responses.create(input="And a dog?", previous_response_id=r1.id, instructions=INSTRUCTIONS, **kw)
    assert r3.usage.input_tokens_details.cached_tokens >= pinned * 16 > 0
    assert _chat_cached(cl, OTHER, "Hi there!") == 0  # evicted by the same traffic
    # Tenant B, same instructions: A's pinned blocks are not its hit (key isolation).
    rb = _client(c, B).responses.create(input="What is a fox?", instructions=INSTRUCTIONS, **kw)
    assert rb.usage.input_tokens_details.cached_tokens == 0
    _on_engine(engine, lambda e: e.check_invariants())
    assert _on_engine(engine, lambda e: e.pins.num_blocks) <= budget
    # Every response holding the A pin deleted (B's own pin stays until B's is): released.
    for r in (r1, r2, r3):
        cl.responses.delete(r.id)
    _client(c, B).responses.delete(rb.id)
    assert _on_engine(engine, lambda e: (e.pins.num_blocks, len(e.pins.pins))) == (0, 0)
    _pressure(cl, 2, num_blocks)
    r4 = cl.responses.create(input="What is a fox?", instructions=INSTRUCTIONS, **kw)
    assert r4.usage.input_tokens_details.cached_tokens == 0
    cl.responses.delete(r4.id)
    # Nothing held once every request is done and every pin released.
    assert _on_engine(engine, lambda e: (e.kv.pool.num_free_blocks == e.kv.pool.num_blocks,
                                         e.check_invariants())) == (True, None)


def test_tools_alone_are_a_stable_prefix(served):
    c, engine = served
    cl = _client(c)
    weather = {"type": "object", "properties": {"city": {"type": "string", "description": "a city name, in full"}}}
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather of a city, "
              "in degrees and words", "parameters": weather}]
    r = cl.responses.create(model=MODEL, input="Hi.", tools=tools, max_output_tokens=2)
    assert _on_engine(engine, lambda e: e.pins.num_blocks) > 0
    cl.responses.delete(r.id)
    assert _on_engine(engine, lambda e: e.pins.num_blocks) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_not_stored_pins_nothing(served, stream):
    """store: false keeps nothing, so nothing could delete a pin it made: it makes none. And a
    reply cut short by max_output_tokens ends in a message item that says so."""
    c, engine = served
    cl = _client(c)
    r = cl.responses.create(model=MODEL, input="Hi.", instructions=INSTRUCTIONS + " Unstored.", store=False,
                            max_output_tokens=2, temperature=0, stream=stream)
    if stream:
        r = [e.response for e in list(r) if e.type in ("response.completed", "response.incomplete")][0]
    assert r.status == "incomplete" and r.output[-1].status == "incomplete", r
    assert _on_engine(engine, lambda e: (e.pins.num_blocks, len(e.pins.pins))) == (0, 0)
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(r.id)
