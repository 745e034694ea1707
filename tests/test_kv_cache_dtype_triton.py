"""Compressed KV cache on the Triton backend (its kernels in the interpreter on the CPU): the same
greedy tokens as the PyTorch reference path for every format, on a random Qwen2 model with
chunked prefill, blocks filled mid-chunk and decode steps that seal KIVI blocks; KIVI int4 over
16-token blocks in float16. Two layers: the second checks each layer's offsets into the cache,
and every further layer would only repeat the interpreter's work."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.quality import greedy_agreement, teacher_forced_agreement
from tests.test_kv_cache_dtype import FORMATS, _run
from tests.test_parity_qwen import _make


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Four query heads on two KV heads of 16 channels (the kernels' general path; the prefill
    kernel runs a program per query head, so more heads would only repeat the interpreter's
    work). Seed 12: each format's rounding, and a 5% error in the attention's scale, changes
    some of this model's greedy tokens."""
    return _make(tmp_path_factory.mktemp("qwen"), "qwen2", layers=2, seed=12, num_attention_heads=4,
                 head_dim=16)[1]


@pytest.fixture(scope="module")
def qwen_prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 11, 45, 90)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_backend_matches_reference_path(qwen, qwen_prompts, fmt):
    """block_size 16, chunks of 40 tokens: chunks start and end mid-block, KIVI seals blocks from
    the residual plus the new chunk, decode steps seal one block at a time (8 tokens: the prompts
    of 11 and 45 cross a block boundary while decoding; each step is the interpreter's time)."""
    kw = dict(show_progress=False, kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=40, dtype="float32",
              kv_cache_dtype=fmt)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = LLM(qwen, attention_backend="torch", **kw)
    want = _run(ref, qwen_prompts, params)
    llm = LLM(qwen, attention_backend="triton", **kw)
    got = _run(llm, qwen_prompts, params)
    assert got == want
    # The compression is real: each format's keys and values change this model's choices.
    full = _run(LLM(qwen, attention_backend="torch", **{**kw, "kv_cache_dtype": "auto"}), qwen_prompts, params)
    assert greedy_agreement(got, full) < 1.0
    # A prompt alone attends through SDPA on its own K/V in full precision where the cache is
    # compressed, as the reference path does. One format per route (8-bit, KIVI), and three tokens:
    # a lone decode step takes the most splits, each the interpreter's time.
    if fmt in ("fp8", "int4"):
        p, short = qwen_prompts[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        assert _run(llm, [p], short) == _run(ref, [p], short), f"a lone prompt of {len(p)} tokens"
    for e in (ref, llm):
        assert e.engine.kv.pool.num_used_blocks == 0
        assert not e.engine.runner.kv_cache._row


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("qwen3"), "qwen3", layers=2)[1]  # head_dim 32: int4's fast path


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kivi_16_token_blocks_in_float16_triton(qwen3, qwen_prompts):
    """int4 over 16-token blocks in a float16 model on the Triton kernels (the interpreter
    here; 16-key tiles were once wrong on the H200 and refused): it starts, and given the
    PyTorch reference path's float16 continuations its next-token choices mostly agree. The two
    paths round differently (q * scale against dequantized keys), and this small random model
    parts on such differences, so agreement is not total; wrong attention would agree on few.
    The kernels' precision is tested against float64 in tests/kernels/test_kv_quant.py."""
    kw = dict(show_progress=False, kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=40,
              dtype="float16", kv_cache_dtype="int4")
    llm = LLM(qwen3, attention_backend="triton", **kw)
    assert llm.engine.runner.kv_format.block_size == 16
    prompts = qwen_prompts[:3]  # up to 45 tokens: two chunks, blocks sealed while prefilling and decoding
    want = _run(LLM(qwen3, attention_backend="torch", **kw), prompts)
    # Free-running, it decodes (8 tokens: the prompts of 11 and 45 seal a block on the way);
    # the agreement is measured over the reference's 16 tokens a prompt.
    got = _run(llm, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert teacher_forced_agreement(llm, prompts, want) >= 0.7, (got, want)
    assert llm.engine.kv.pool.num_used_blocks == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", ["fp8"])
def test_lone_prompt_past_its_window_into_a_compressed_cache(tmp_path, fmt):
    """Gemma 3's local layers, a compressed cache. A lone prompt shorter than the window attends
    through SDPA to its own K/V in full precision, as the reference path's lone prompt does. One
    longer than the window takes the paged prefill kernel (SDPA's causal kernel knows no window),
    which reads the K/V back from the cache: the reference path's tokens for the same prompt in
    a batch, where it reads its cache too (with int8 keys the two differ on this random model)."""
    from tests.test_parity_gemma3 import make_gemma3, prompts_of
    window = 12
    _, path = make_gemma3(tmp_path, window, 1)
    kw = dict(show_progress=False, kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=64,
              dtype="float32", kv_cache_dtype=fmt)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref, llm = LLM(path, attention_backend="torch", **kw), LLM(path, attention_backend="triton", **kw)
    long, short = prompts_of((2 * window + 6, window - 3), seed=4)
    assert _run(llm, [short], params) == _run(ref, [short], params)
    assert _run(llm, [long], params) == _run(ref, [long, short], params)[:1]
