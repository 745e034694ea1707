"""Request fields agent frameworks send, through the official openai client: echo (with the
prompt's logprobs checked against transformers), best_of, stop_token_ids, min_tokens,
chat_template_kwargs and a server started with --chat-template; /v1/embeddings against
transformers' hidden states."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_proc import ServerProcess

TINY = "tiny"
SMOL = "smol"
PROMPT = [5, 17, 99, 3, 42]
# A template of our own, with a variable only chat_template_kwargs sets.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    s = ServerProcess("--model", "dummy:tiny", "--kv-cache-memory", "64MiB", "--served-model-name", TINY)
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
    s.stop()


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess("--served-model-name", SMOL, "--kv-cache-memory", "256MiB", "--chat-template", str(path))
    yield s
    s.stop()


def _ids(tokens: list[str]) -> list[int]:
    """dummy:tiny has no tokenizer, so logprob tokens read "token_id:N"."""
    return [int(t.split(":")[1]) for t in tokens]


def _greedy(tiny, **kw):
    r = tiny.completions.create(model=TINY, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                extra_body={"ignore_eos": True, **kw})
    return _ids(r.choices[0].logprobs.tokens), r.choices[0]


def test_stop_token_ids_and_min_tokens(tiny):
    ids, _ = _greedy(tiny)
    stop = ids[2]
    first = ids.index(stop)
    got, c = _greedy(tiny, stop_token_ids=[stop])
    assert got == ids[:first + 1] and c.finish_reason == "stop"
    # min_tokens holds the stop token back until that many tokens are out
    got, c = _greedy(tiny, stop_token_ids=[stop], min_tokens=first + 3)
    assert len(got) >= first + 3 and stop not in got[:first + 3]
    assert (c.finish_reason, got[-1]) == ("stop", stop) if c.finish_reason == "stop" else \
        (c.finish_reason, len(got)) == ("length", 8)


def test_best_of_returns_the_n_most_likely_samples(tiny):
    kw = dict(model=TINY, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, logprobs=0,
              extra_body={"ignore_eos": True})
    every = tiny.completions.create(n=5, **kw).choices
    total = {tuple(c.logprobs.tokens): sum(c.logprobs.token_logprobs) for c in every}
    assert len(set(total.values())) > 2  # the samples differ, so the choice is not trivial
    best = tiny.completions.create(n=2, **{**kw, "extra_body": {"ignore_eos": True, "best_of": 5}})
    assert [c.index for c in best.choices] == [0, 1]
    want = sorted(total, key=lambda t: -total[t])[:2]
    assert [tuple(c.logprobs.tokens) for c in best.choices] == want
    assert best.usage.completion_tokens == 5 * 6  # every sample was generated
    quiet = tiny.completions.create(n=1, **{**kw, "logprobs": None, "extra_body": {"ignore_eos": True,
                                                                                   "best_of": 5}})
    assert quiet.choices[0].logprobs is None


@pytest.mark.parametrize("kw, words", [
    (dict(n=3, extra_body={"best_of": 2}), [">= n (3)"]),
    (dict(extra_body={"best_of": 0}), ["[1, 128]"]),
    (dict(stream=True, extra_body={"best_of": 2}), ["stream"]),
    (dict(extra_body={"stop_token_ids": [2**63]}), ["stop_token_ids"]),
    (dict(extra_body={"stop_token_ids": [-1]}), ["stop_token_ids"]),
])
def test_bad_fields_are_400(tiny, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        r = tiny.completions.create(model=TINY, prompt=PROMPT, max_tokens=2, **kw)
        list(r) if kw.get("stream") else None
    body = e.value.body
    assert body["param"] in ("best_of", "stop_token_ids[0]") and all(w in body["message"] for w in words), body


@pytest.mark.slow  # the default model and transformers' reference
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_prompt_logprobs_matches_transformers(smol, hf_model, stream):
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)
    prompt = "The capital of France is"
    ids = httpx.post(f"{smol.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    kw = dict(model=SMOL, prompt=prompt, max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    r = client.completions.create(echo=True, logprobs=2, stream=stream, **kw)
    chunks = list(r) if stream else [r]
    text = "".join(ch.choices[0].text for ch in chunks)
    lps = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    tokens = [t for lp in lps for t in lp.tokens]
    values = [v for lp in lps for v in lp.token_logprobs]
    tops = [t for lp in lps for t in lp.top_logprobs]
    offsets = [o for lp in lps for o in lp.text_offset]
    assert text == prompt + plain
    assert len(tokens) == len(values) == len(tops) == len(ids) + 4 and values[0] is None and tops[0] is None
    assert "".join(tokens) == text and offsets == [len("".join(tokens[:j])) for j in range(len(tokens))]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i in range(1, len(ids)):
        assert values[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        assert len(tops[i]) == 2 and max(tops[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=2e-3)


@pytest.mark.slow  # the default model
def test_chat_template_file_and_kwargs(smol):
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=SMOL, messages=msgs, max_tokens=1).usage.prompt_tokens
    r = client.chat.completions.create(model=SMOL, messages=msgs, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    think = httpx.post(f"{smol.url}/tokenize", json={"prompt": "<think></think>\n",
                                                     "add_special_tokens": False}).json()["count"]
    # our template replaced SmolLM2's (no default system prompt), and the variable reached it
    assert plain == httpx.post(f"{smol.url}/tokenize", json={"prompt": "<|im_start|>user\nHi<|im_end|>\n"
                                                             "<|im_start|>assistant\n",
                                                             "add_special_tokens": False}).json()["count"]
    assert r.usage.prompt_tokens == plain + think
    for bad, param in [({"tools": []}, "chat_template_kwargs.tools"),
                       ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                       ({"messages": []}, "chat_template_kwargs.messages")]:  # what the template renders with
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SMOL, messages=msgs, max_tokens=1,
                                           extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] == param
    r = httpx.post(f"{smol.url}/tokenize", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


@pytest.mark.slow  # the default model and transformers' reference
def test_embeddings_match_transformers_and_leave_generation_alone(smol, hf_model):
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)
    texts = ["The capital of France is Paris.", "Memory decides what inference costs."]
    ids = [httpx.post(f"{smol.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    with torch.no_grad():
        refs = [torch.nn.functional.normalize(hf_model.model(torch.tensor([i])).last_hidden_state[0].mean(0), dim=0)
                for i in ids]
    # the official client asks for base64 and decodes it; plain JSON floats the same
    r = client.embeddings.create(model=SMOL, input=texts)
    raw = httpx.post(f"{smol.url}/v1/embeddings", json={"model": SMOL, "input": ids[1], "encoding_format": "float",
                                                        "dimensions": 576}).json()
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(map(len, ids))
    for got, ref in zip([r.data[0].embedding, r.data[1].embedding, raw["data"][0]["embedding"]], refs + refs[1:]):
        assert len(got) == 576 and (torch.tensor(got) - ref).abs().max().item() < 1e-4
    # an embedding computed while a generation streams changes nothing in it
    kw = dict(model=SMOL, prompt="Once upon a time", max_tokens=16, temperature=0)
    alone = client.completions.create(**kw).choices[0].text
    text = ""
    for j, ch in enumerate(client.completions.create(stream=True, **kw)):
        text += ch.choices[0].text if ch.choices else ""
        if j in (1, 5):
            client.embeddings.create(model=SMOL, input=texts[j % 2])
    assert text == alone
    for body, param in [({"input": "x", "dimensions": 64}, "dimensions"), ({"input": []}, "input"),
                        ({"input": ["ok", ""]}, "input[1]"), ({"input": [[1, 2], [3, 10**9]]}, "input[1]"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format")]:
        e = httpx.post(f"{smol.url}/v1/embeddings", json={"model": SMOL, **body})
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text


@pytest.mark.slow  # the default model
@pytest.mark.parametrize("stream", [False, True])
def test_characters_split_across_tokens_keep_their_bytes_and_offsets(smol, stream):
    """An emoji or a CJK character takes several byte-level tokens, each part of its UTF-8 bytes
    (shown as U+FFFD). Chat logprobs' ``bytes`` are the tokens' own: joined, the content's UTF-8.
    Completions' ``text_offset`` counts characters of the text: a token that begins a whole
    character begins where the text has it."""
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Repeat exactly: 🎉🎉🎉"}],
                                       max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=stream)
    chunks = list(r) if stream else [r]
    content = "".join((ch.choices[0].delta.content or "") if stream else ch.choices[0].message.content
                      for ch in chunks if ch.choices)
    lps = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert "🎉" in content, content
    assert bytes(b for t in lps for b in t.bytes) == content.encode()
    assert all(t.top_logprobs[0].bytes == t.bytes for t in lps)  # greedy: the top one is the chosen one
    prompt = "Party 🎉🎉, café, 日本語 and ok"
    c = client.completions.create(model=SMOL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=0,
                                  stream=stream)
    chunks = list(c) if stream else [c]
    text = "".join(ch.choices[0].text for ch in chunks)
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert text.startswith(prompt) and len(offsets) == len(tokens) and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    whole = [(t, o) for t, o in zip(tokens, offsets, strict=True) if "\ufffd" not in t]
    assert len(whole) >= len(tokens) // 2
    assert all(text.startswith(t, o) for t, o in whole), [(t, o, text[o:o + len(t)]) for t, o in whole]
