"""Model names as vLLM has them and usage.prompt_tokens_details.cached_tokens as OpenAI reports it,
through the official openai package.

--served-model-name takes several names: /v1/models lists them, the first first; a request may
send any of them; responses carry the first. Without it the model's file name is the name (and
--model as given); a name that is not served is a 404 `model_not_found` that lists the served ones.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import openai
import pytest
from server_proc import REPO, ServerProcess

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import streams
from kvserve.server.state import default_names

NAMES = ["tiny", "tiny-alias", "org/tiny"]
# A long prompt, so a second identical one finds many full KV blocks in the prefix cache.
TEXT = ("The paged KV cache stores the keys and values of every token in fixed-size blocks; a block "
        "that holds a prompt prefix seen before is reused instead of being computed again. ") * 8


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


# -- several served names (dummy:tiny, no tokenizer) -------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    s = ServerProcess("--model", "dummy:tiny", "--kv-cache-memory", "16MiB", "--served-model-name", *NAMES)
    yield s
    s.stop()


def test_models_lists_served_names_first_first(tiny):
    assert [m.id for m in _client(tiny).models.list().data] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_any_served_name_is_accepted_and_responses_carry_the_first(tiny, name):
    c = _client(tiny)
    r = c.completions.create(model=name, prompt=[1, 2, 3], max_tokens=2, extra_body={"ignore_eos": True})
    assert r.model == NAMES[0] and r.usage.completion_tokens == 2
    chunks = list(c.completions.create(model=name, prompt=[1, 2, 3], max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks and all(ch.model == NAMES[0] for ch in chunks)


@pytest.mark.parametrize("name", ["dummy:tiny", "TINY", "tiny "])
def test_unserved_name_is_404_naming_the_served_ones(tiny, name):
    with pytest.raises(openai.NotFoundError) as e:
        _client(tiny).completions.create(model=name, prompt=[1], max_tokens=1)
    err = e.value.body
    assert e.value.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "not_found_error"
    assert f"`{name}`" in err["message"] and all(f"`{n}`" in err["message"] for n in NAMES)


@pytest.mark.parametrize("argv", [["--served-model-name", ""], ["--served-model-name", "a", " "],
                                  ["--served-model-name"]])
def test_empty_served_model_name_is_an_error_naming_the_flag(argv):
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", "dummy:tiny", *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--served-model-name" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_default_names_are_the_file_name_and_the_model_as_given():
    def engine(model_name, model):
        return SimpleNamespace(model_name=model_name, config=SimpleNamespace(model=model))
    assert default_names(engine("m.gguf", None)) == ("m.gguf",)
    assert default_names(engine("m.gguf", "m.gguf")) == ("m.gguf",)
    assert default_names(engine("m.gguf", "models/m.gguf")) == ("m.gguf", "models/m.gguf")


def test_usage_reports_engine_cached_tokens_and_none_as_zero():
    def out(n_prompt, cached):
        c = CompletionOutput(index=0, text="", token_ids=[7, 8], cumulative_logprob=None, logprobs=None)
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=list(range(n_prompt)),
                             prompt_logprobs=None, outputs=[c], finished=True, num_cached_tokens=cached)
    u = streams.usage([out(40, 32), out(20, None), out(30, 16)])
    assert (u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens) == (90, 6, 48)
    assert streams.usage([out(5, None)]).prompt_tokens_details.cached_tokens == 0


# -- the default model without --served-model-name: its file name; cached tokens ----------------

@pytest.fixture(scope="module")
def smol():
    s = ServerProcess("--kv-cache-memory", "256MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def file_name(model_path):
    return os.path.basename(model_path)


def test_default_name_is_the_model_file_name(smol, file_name):
    c = _client(smol)
    assert [m.id for m in c.models.list().data] == [file_name]
    r = c.completions.create(model=file_name, prompt="Hello", max_tokens=1)
    assert r.model == file_name
    stem = file_name.removesuffix(".gguf")  # vLLM accepts served names only
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model=stem, prompt="Hello", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and f"`{file_name}`" in e.value.body["message"]


def _cached(usage) -> int:
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.prompt_tokens
    return cached


def test_cached_tokens_on_a_repeated_long_prompt(smol, file_name):
    """The first request of a prompt that starts with a fresh id computes (almost) all of it; the
    same prompt again finds it in the prefix cache: chat, completions, streamed usage chunks."""
    c = _client(smol)

    def chat(content, stream):
        kw = dict(model=file_name, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)
        if not stream:
            return c.chat.completions.create(**kw).usage
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == []
        return chunks[-1].usage

    def complete(prompt, stream):
        kw = dict(model=file_name, prompt=prompt, max_tokens=4, temperature=0)
        if not stream:
            return c.completions.create(**kw).usage
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == []
        return chunks[-1].usage

    for call in (chat, complete):
        for stream in (False, True):
            prompt = f"{uuid.uuid4().hex} {TEXT}"
            first, second = call(prompt, stream), call(prompt, stream)
            assert first.prompt_tokens == second.prompt_tokens > 200
            half = first.prompt_tokens // 2
            assert _cached(first) < half <= _cached(second), (call.__name__, stream, first, second)


def test_chat_cache_salt_shares_only_with_the_same_salt(smol, file_name):
    """cache_salt on chat (the real model's template): a system prompt cached under one salt is a
    hit for that salt only."""
    c = _client(smol)
    system = f"{uuid.uuid4().hex} {TEXT}"

    def cached(salt, question):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        extra = {} if salt is None else {"cache_salt": salt}
        return _cached(c.chat.completions.create(model=file_name, messages=msgs, max_tokens=2, temperature=0,
                                                 extra_body=extra).usage)

    assert cached("alice", "What is a block?") < 32
    assert cached("bob", "What is a page?") < 32  # alice's system prompt is not bob's to hit
    assert cached(None, "What is a cache?") < 32
    assert cached("alice", "What is a table?") > 200
