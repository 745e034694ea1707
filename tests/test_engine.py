"""End-to-end engine behaviour on the real default model: n > 1 with copy-on-write, seeded
sampling across batch compositions, log-probs and prompt log-probs against transformers, stop
conditions, and KV bookkeeping on a mixed workload."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.prompts import CHAT_QUESTIONS, chat_prompt


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, show_progress=False, kv_cache_memory="256MiB")


def _ids(llm, question):
    return {"prompt_token_ids": chat_prompt(llm.get_tokenizer(), question)}


def test_n_greedy_shares_prompt_and_copies_on_write(llm, hf_model):
    prompt = _ids(llm, "Name a planet.")
    n_prompt = len(prompt["prompt_token_ids"])
    assert n_prompt % llm.engine.block_size != 0  # the last prompt block is partial, so shared then copied
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=12, temperature=0), use_tqdm=False)[0]
    want = hf_greedy(hf_model, prompt["prompt_token_ids"], 12, 2)
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.token_ids == want
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.check_invariants()


def test_seeded_sampling_independent_of_batch(llm):
    target = _ids(llm, "Tell me a story about a cat.")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [_ids(llm, q) for q in CHAT_QUESTIONS[:4]]
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(max_tokens=20, temperature=1.0)] * 2 + [params]
                         + [SamplingParams(max_tokens=8, temperature=0.5, seed=9)] * 2, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    # Another seed gives another continuation (the seed is really used).
    other = llm.generate(target, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_parallel_samples_reproducible(llm):
    p = _ids(llm, "Write one word.")
    sp = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7)
    a = llm.generate(p, sp, use_tqdm=False)[0]
    b = llm.generate([_ids(llm, "Hi"), p], [SamplingParams(max_tokens=5), sp], use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the 4 samples are not copies


def test_logprobs_match_transformers(llm, hf_model):
    ids = chat_prompt(llm.get_tokenizer(), "What is the capital of Italy?")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    full = ids + comp.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([full])).logits[0].float().log_softmax(-1)
    # Prompt log-probs: entry i is log P(prompt[i] | prompt[:i]); the first has none.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        lp = out.prompt_logprobs[i][ids[i]]
        assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        assert lp.rank == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert len(out.prompt_logprobs[i]) <= 3
    # Sampled-token log-probs and the top-3.
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, tok in enumerate(comp.token_ids):
        row = ref[len(ids) - 1 + j]
        d = comp.logprobs[j]
        assert d[tok].logprob == pytest.approx(row[tok].item(), abs=2e-3) and d[tok].rank == 1
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(d)
        total += d[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_stop_token_ids_min_tokens_ignore_eos(llm):
    p = _ids(llm, "What is the capital of France?")
    base = llm.generate(p, SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop" and base.token_ids[-1] == 2  # ended by <|im_end|>
    # A stop token id taken from the middle of the greedy answer ends it there.
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    o = llm.generate(p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok]),
                     use_tqdm=False)[0].outputs[0]
    assert o.token_ids == base.token_ids[:first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    # ignore_eos runs to max_tokens; min_tokens keeps EOS away until reached.
    o = llm.generate(p, SamplingParams(max_tokens=len(base.token_ids) + 5, temperature=0, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == len(base.token_ids) + 5 and o.finish_reason == "length"
    o = llm.generate(p, SamplingParams(max_tokens=40, min_tokens=len(base.token_ids) + 2, temperature=0),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) >= len(base.token_ids) + 2
    assert 2 not in o.token_ids[: len(base.token_ids) + 1]
    # A stop string cuts the text and is excluded.
    word = base.text.split()[2]
    o = llm.generate(p, SamplingParams(max_tokens=30, temperature=0, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == word and word not in o.text
    assert base.text.startswith(o.text)


def test_mixed_workload_kv_waste_and_stats():
    """KV waste stays under 4% on a mixed workload (it depends on lengths, not weights)."""
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="64MiB", max_model_len=2048)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randint(32, 512))]}
               for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(16, 256), temperature=0, ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    s = llm.stats
    assert s.num_requests_finished == 24
    assert s.generation_tokens == sum(p.max_tokens for p in params)
    assert 0.0 < s.mean_kv_waste < 0.04, s.mean_kv_waste
    assert s.last.kv_blocks_used == 0 and s.last.num_running == 0 and s.last.num_waiting == 0
    assert "tok/s" in s.summary()


def test_streamed_text_never_shows_part_of_a_stop_string(llm):
    p = _ids(llm, "What is the capital of France?")
    base = llm.generate(p, SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0].outputs[0].text
    words = base.split()
    stop = " ".join(words[3:5])  # two words: spans several tokens
    eng = llm.engine
    eng.add_request("stream-stop", p, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step()]
    final = texts[-1]
    assert final == base[:base.index(stop)]
    for t in texts:  # every intermediate text is a prefix of the final one: nothing taken back
        assert final.startswith(t), (t, final)
