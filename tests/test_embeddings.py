"""Embeddings (LLM.embed) against transformers' own Llama on the same GGUF weights: the final
hidden states, mean- or last-token-pooled and L2-normalised, agree within 1e-4 per dimension."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Memory decides what inference costs. " * 12, "Hi"]


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, kv_cache_memory="64MiB")


def reference(hf_model, ids: list[int], how: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(h.mean(0) if how == "mean" else h[-1], dim=0)


@pytest.mark.parametrize("how", ["mean", "last"])
def test_pooled_hidden_states_match_transformers(llm, hf_model, tokenizer, how):
    got = llm.embed(TEXTS, how)
    assert len(got) == len(TEXTS)
    for text, vec in zip(TEXTS, got):
        ref = reference(hf_model, tokenizer.encode(text, add_special_tokens=True), how)
        v = torch.tensor(vec)
        assert v.shape == ref.shape and torch.linalg.vector_norm(v).item() == pytest.approx(1.0, abs=1e-5)
        assert (v - ref).abs().max().item() < 1e-4
    # different texts, different vectors (the pooling does not wash the input out)
    assert torch.dot(torch.tensor(got[0]), torch.tensor(got[2])).item() < 0.99


def test_bad_prompts_name_the_field(model_path):
    """Validation needs no real weights: dummy:tiny with the default model's tokenizer."""
    from kvserve.errors import InvalidRequestError
    llm = LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False)
    with pytest.raises(InvalidRequestError, match="prompts\\[1\\]"):
        llm.embed([[5, 17], [1, 2, 10**9]])
    with pytest.raises(InvalidRequestError, match="prompts\\[0\\]: must not be empty"):
        llm.embed([""])
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("x", "max")


@pytest.fixture(scope="module")
def small_budget():
    return LLM(show_progress=False, kv_cache_memory="64MiB", max_num_batched_tokens=16)


@pytest.mark.parametrize("how", ["mean", "last"])
def test_long_input_runs_in_chunks_of_the_token_budget(small_budget, hf_model, tokenizer, how, monkeypatch):
    """A budget of 16 tokens: a 73-token input runs as five forwards over one scratch cache (the
    later chunks attend to the earlier ones' keys and values), still matching transformers."""
    runner = small_budget.engine.runner
    calls = []
    forward = runner.hidden_states
    monkeypatch.setattr(runner, "hidden_states",
                        lambda ids, start=0, total=None, job=-1: calls.append((len(ids), start)) or
                        forward(ids, start, total, job))
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=True)
    assert len(ids) > 64
    v = torch.tensor(small_budget.embed(ids, how)[0])
    assert calls == [(min(16, len(ids) - s), s) for s in range(0, len(ids), 16)]
    assert (v - reference(hf_model, ids, how)).abs().max().item() < 1e-4
    assert runner.embedding_kv == {}  # the scratch cache went with the last chunk


def test_an_input_abandoned_between_chunks_frees_its_scratch(model_path):
    llm = LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False,
              max_num_batched_tokens=8)
    eng = llm.engine
    job = eng.embedding(list(range(1, 30)), "mean")
    eng.embedding_step(job)
    assert not job.done and job.done_tokens == 8 and list(eng.runner.embedding_kv) == [job.job]
    job.close()
    assert eng.runner.embedding_kv == {}
    # a failing chunk frees it too
    job = eng.embedding(list(range(1, 30)), "last")
    eng.embedding_step(job)
    with pytest.raises(RuntimeError, match="boom"):
        def fail(*a):
            raise RuntimeError("boom")
        eng.runner.model, model = fail, eng.runner.model
        try:
            eng.embedding_step(job)
        finally:
            eng.runner.model = model
    assert eng.runner.embedding_kv == {}


def test_the_server_runs_its_steps_between_an_inputs_chunks():
    """An embedding served beside a generation: the engine thread takes one chunk per pass (a
    drain applies only the commands queued when it began: the next chunk, queued in reply to the
    last, waits for the step), so while the generation runs a step follows every chunk, and both
    requests get what they asked for."""
    import asyncio

    import httpx

    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.server.app import build_app
    eng = LLM("dummy:tiny", kv_cache_memory="16MiB", max_num_batched_tokens=8, show_progress=False).engine
    events = []
    forward, step = eng.runner.hidden_states, eng.step
    eng.runner.hidden_states = lambda ids, *a: events.append("chunk") or forward(ids, *a)
    eng.step = lambda: events.append("step") or step()
    ae = AsyncEngine(eng)
    app = build_app(ae, "tiny")

    async def main():
        ae.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            gen = c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 40,
                                                  "ignore_eos": True}, timeout=60)
            emb = c.post("/v1/embeddings", json={"model": "tiny", "input": [list(range(1, 121)), [7, 8, 9]],
                                                 "encoding_format": "float"}, timeout=60)
            return await asyncio.gather(gen, emb)
    try:
        g, e = asyncio.run(main())
    finally:
        ae.shutdown()
    assert g.status_code == 200 and g.json()["usage"]["completion_tokens"] == 40, g.text
    assert e.status_code == 200 and e.json()["usage"]["prompt_tokens"] == 123, e.text
    vecs = [d["embedding"] for d in e.json()["data"]]
    assert [len(v) for v in vecs] == [eng.arch.hidden_size] * 2
    assert events.count("chunk") == 15 + 1
    # While the generation runs (its first step to its last), a step comes between two chunks.
    running = events[events.index("step"):len(events) - events[::-1].index("step")]
    assert "chunk" in running and not any(a == b == "chunk" for a, b in zip(running, running[1:])), events
    assert eng.runner.embedding_kv == {}
