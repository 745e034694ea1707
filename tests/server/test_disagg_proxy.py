"""`kvserve disagg-proxy` in front of a prefill and a decode `kvserve serve` over gloo, through
the official openai client: the tokens equal one engine's (streamed or not), the decode side
reports the prompt's full blocks as cached, and errors come back in OpenAI's shape."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_proc import REPO, ServerProcess, free_port

from kvserve import LLM, SamplingParams
from kvserve.server.disagg_proxy import build_proxy_app

MODEL = "tiny"
TINY = ["--model", "dummy:tiny", "--kv-cache-memory", "16MiB", "--served-model-name", MODEL]
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(1, 512) for _ in range(n)] for n in (100, 75)]
MAX_TOKENS = 8


def kv_cfg(role: str, port: int) -> str:
    return json.dumps({"kv_connector": "TorchDistributedConnector", "kv_role": role, "kv_port": port})


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def instances():
    port = free_port()
    with ThreadPoolExecutor(2) as ex:  # each waits for the other to connect before it is healthy
        prefill, decode = ex.map(lambda role: ServerProcess(*TINY, "--kv-transfer-config", kv_cfg(role, port),
                                                   startup_timeout=300),
                                 ["kv_producer", "kv_consumer"])
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "disagg-proxy", "--prefill", prefill.url,
                              "--decode", decode.url, "--port", str(proxy_port)], cwd=REPO)
    url = f"http://127.0.0.1:{proxy_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield prefill, decode, url
    proxy.kill()
    proxy.wait(10)
    decode.stop()
    prefill.stop()


def ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)  # dummy:tiny has no tokenizer
    return [int(t.split(":")[1]) for t in tokens]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_completion_through_the_proxy(instances, reference):
    prefill, decode, url = instances
    r = client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=0, extra_body={"ignore_eos": True})
    assert ids(r.choices[0].logprobs.tokens) == reference[0]
    assert r.usage.prompt_tokens_details.cached_tokens == (len(PROMPTS[0]) - 1) // 16 * 16
    for s in (prefill, decode):
        assert s.wait_idle()["kvserve_kv_blocks_used"] == 0


def test_streamed_completion_through_the_proxy(instances, reference):
    _, _, url = instances
    stream = client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    tokens, usage = [], None
    for chunk in stream:
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
        usage = chunk.usage or usage
    assert ids(tokens) == reference[1]
    assert usage.prompt_tokens_details.cached_tokens == (len(PROMPTS[1]) - 1) // 16 * 16


def test_bad_request_is_the_instances_400(instances):
    _, _, url = instances
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=5)
    assert e.value.body["param"] == "temperature" and "[0, 2]" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="no-such-model", prompt=PROMPTS[0], max_tokens=4)


def test_unreachable_instance_is_502_in_openais_shape(instances):
    _, decode, _ = instances
    dead = f"http://127.0.0.1:{free_port()}"
    for app, which in ((build_proxy_app(dead, decode.url), "prefill"), (build_proxy_app(decode.url, dead), None)):
        with TestClient(app) as tc:
            r = tc.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
            if which is None:  # the "prefill" is a consumer here: it answers, then the decode is gone
                which = "decode"
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "upstream_unreachable" and which in err["message"] and err["type"]
            assert tc.post("/v1/completions", content=b"{not json").status_code == 400
