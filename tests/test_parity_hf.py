"""Greedy output token-identical to Hugging Face transformers on the default model's GGUF (fp32).

All prompts run together in one batch through kvserve; the reference runs each prompt alone,
unpadded, through transformers' own Llama on the same weights.
"""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.prompts import parity_prompts, shared_prefix_prompts

MAX_NEW = 24
EOS = 2
pytestmark = pytest.mark.slow  # the default model's real weights in fp32, and transformers beside them


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return parity_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_NEW, EOS) for p in prompts]


@pytest.fixture(scope="module")
def prefix_prompts(tokenizer):
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def prefix_reference(hf_model, prefix_prompts):
    return [hf_greedy(hf_model, p, MAX_NEW, EOS) for p in prefix_prompts]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got, want, prompts):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i} ({len(prompts[i])} tokens): kvserve {g} != transformers {w}"


def test_batch_matches_transformers(model_path, prompts, reference):
    llm = LLM(model_path, show_progress=False, kv_cache_memory="256MiB", enable_prefix_caching=False)
    got = run(llm, prompts)
    assert_same(got, reference, prompts)
    assert llm.engine.kv.pool.num_used_blocks == 0  # every block back in the pool
    stats = llm.stats
    assert stats.generation_tokens == sum(len(r) for r in reference)


def test_prefix_caching_matches_transformers(model_path, prompts, reference, prefix_prompts, prefix_reference):
    llm = LLM(model_path, show_progress=False, kv_cache_memory="256MiB", enable_prefix_caching=True)
    # The first pass fills the cache (prompts sharing a prefix also hit each other within a batch)...
    assert_same(run(llm, prefix_prompts), prefix_reference, prefix_prompts)
    hits_first = llm.engine.kv.prefix_hits
    # ...and a second pass is served mostly from it, with the same tokens.
    assert_same(run(llm, prefix_prompts), prefix_reference, prefix_prompts)
    assert llm.engine.kv.prefix_hits - hits_first >= sum(len(p) for p in prefix_prompts) * 0.8
    assert llm.stats.last.prefix_hit_rate > 0.4
    # The varied set with a warm cache (the 1,100-token prompt's blocks) also matches.
    assert_same(run(llm, prompts), reference, prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap", "reserve"])
def test_preemption_matches_transformers(model_path, prompts, reference, mode):
    # The prompts under 600 tokens (~570 tokens, ~40 blocks) in a pool of 48 blocks: without a
    # decode reserve all are admitted, then their growth runs the pool dry and the newest are
    # preempted mid-decode; with the default one, learned from 1, admission waits instead.
    keep = [i for i, p in enumerate(prompts) if len(p) < 600]
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16  # K+V, 30 layers, 3 KV heads, head 64, fp32, 16 tokens
    llm = LLM(model_path, show_progress=False, kv_cache_memory=block_bytes * 48,
              preemption_mode="recompute" if mode == "reserve" else mode, swap_space="256MiB",
              enable_prefix_caching=False, decode_reserve=None if mode == "reserve" else 0)
    got = run(llm, [prompts[i] for i in keep])
    assert (llm.engine.scheduler.num_preemptions > 0) == (mode != "reserve")
    assert_same(got, [reference[i] for i in keep], [prompts[i] for i in keep])
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(model_path, prompts, reference):
    llm = LLM(model_path, show_progress=False, kv_cache_memory="256MiB", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    got = run(llm, prompts)
    assert_same(got, reference, prompts)
