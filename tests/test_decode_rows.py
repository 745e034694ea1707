"""Steps of a few tokens per sequence run as decode rows (``kvserve/engine/decode_rows.py``):
the rows' metadata is that of one-token sequences at each position; their logits match the
prefill-shaped step's on random models (GQA, a sliding window, an 8-bit cache); speculative
decoding through them is token-identical to decoding without drafts (n-gram and draft model,
mixed batches, preemption) and leaks no KV block."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import KernelConfig
from kvserve.engine import decode_rows
from kvserve.layers.attention import AttentionMetadata, ForwardContext, forward_context
from tests.test_speculative import _prompts, _stepwise

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "model": "dummy:tiny-draft", "num_speculative_tokens": 3}


def _llm(model="dummy:tiny", mode="always", spec=None, **kw):
    """On the CPU on every machine (test_cuda.py has the CUDA graphs' test)."""
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(model, device="cpu", show_progress=False, speculative_config=spec,
               kernel=KernelConfig(decode_rows=mode), **kw)


def _steps(rng, num_blocks, block_size):
    """Random sequences (context, new tokens, a random block table of the blocks they need)."""
    blocks = rng.permutation(num_blocks).tolist()
    seqs = []
    for _ in range(int(rng.integers(1, 6))):
        ctx, q = int(rng.integers(1, 60)), int(rng.integers(1, 10))
        need = -(-(ctx + q) // block_size)
        seqs.append((ctx, q, [blocks.pop() for _ in range(need)]))
    return seqs


def test_rows_are_one_token_sequences_at_each_position():
    """The expansion against its definition: row j of a sequence is a sequence of its own with
    ctx + j tokens cached and one new, on the same block table."""
    llm = _llm()
    rt = llm.engine.runner
    rng = np.random.default_rng(0)
    for _ in range(50):
        seqs = _steps(rng, 64, rt.block_size)
        positions, slots, _, query_start, tables = rt._host_metadata(seqs)
        lens, starts, row_tables = decode_rows.expand(positions, query_start, tables)
        one = [(c + j, 1, t) for c, n, t in seqs for j in range(n)]
        p1, s1, l1, qs1, t1 = rt._host_metadata(one)
        np.testing.assert_array_equal(positions, p1)
        np.testing.assert_array_equal(slots, s1)
        np.testing.assert_array_equal(lens, l1)
        np.testing.assert_array_equal(starts, qs1)
        np.testing.assert_array_equal(row_tables, t1)


@pytest.mark.unit
def test_eligible_steps():
    assert decode_rows.eligible([(5, 3, [0]), (9, 1, [1])])
    assert not decode_rows.eligible([(5, 1, [0]), (9, 1, [1])])  # a decode step already
    assert not decode_rows.eligible([(5, 3, [0]), (0, 4, [1])])  # a fresh prompt
    assert not decode_rows.eligible([(5, decode_rows.MAX_TOKENS + 1, [0])])


@pytest.mark.parametrize("model, kv_dtype, backend", [
    ("dummy:tiny", "auto", "torch"),
    ("dummy:tiny-gemma3", "auto", "torch"),
    ("dummy:tiny", "int8", "torch"),
    # the Triton decode kernel (in its interpreter without a GPU) against its prefill kernel
    pytest.param("dummy:tiny-gemma3", "auto", "triton", marks=pytest.mark.slow),
], ids=["gqa", "gemma3-window", "int8-kv", "gemma3-window-triton"])
def test_rows_logits_match_the_prefill_shape(model, kv_dtype, backend):
    """The same random step both ways over the same cache: every token's logits agree. Contexts
    of up to 60 tokens cross the gemma3 layer's 8-token window."""
    llm = _llm(model, kv_cache_dtype=kv_dtype, dtype="float32", attention_backend=backend)
    rt = llm.engine.runner
    rng = np.random.default_rng(1)
    vocab = rt.arch.vocab_size
    with torch.inference_mode():
        for _ in range(5 if backend == "torch" else 2):
            seqs = _steps(rng, llm.engine.num_kv_blocks, rt.block_size)
            # The context first (prefill-shaped), then the step of a few tokens, both ways.
            rt._forward(rng.integers(1, vocab, sum(c for c, _, _ in seqs)).tolist(),
                        [(0, c, t) for c, _, t in seqs], rows=False)
            ids = rng.integers(1, vocab, sum(n for _, n, _ in seqs)).tolist()
            h_prefill, qs_prefill = rt._forward(ids, seqs, rows=False)
            want = rt._logits(h_prefill)
            h_rows, qs_rows = rt._forward(ids, seqs, rows=True)
            got = rt._logits(h_rows)
            assert qs_rows == qs_prefill
            assert want.abs().max() > 0.1
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def row_steps(monkeypatch):
    """Counts the steps that ran as decode rows."""
    calls = []
    expand = decode_rows.expand

    def counting(positions, query_start, tables):
        calls.append((len(positions), len(query_start) - 1))  # (rows, sequences)
        return expand(positions, query_start, tables)
    monkeypatch.setattr(decode_rows, "expand", counting)
    return calls


@pytest.mark.parametrize("model, spec, kw", [
    ("dummy:tiny", NGRAM, {}),
    ("dummy:tiny", DRAFT, {}),
    ("dummy:tiny-gemma3", NGRAM, {}),
    # prompts chunked into steps with verifies (mixed: the prefill shape) and short last chunks
    ("dummy:tiny", NGRAM, {"max_num_batched_tokens": 24}),
    # 24 blocks of 16 fp32 tokens: six requests cannot all hold their KV at once
    ("dummy:tiny", NGRAM, {"kv_cache_memory": 24 * 16 * 2 * 2 * 2 * 16 * 4, "dtype": "float32", "decode_reserve": 0}),
], ids=["ngram", "draft_model", "gemma3-window", "mixed-batches", "preemption"])
def test_speculative_greedy_identical_through_rows(model, spec, kw, row_steps):
    prompts = _prompts(3, 6)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=1.1)
    kw_plain = {k: v for k, v in kw.items() if k != "max_num_batched_tokens"}
    want = [o.outputs[0].token_ids for o in _llm(model, "never", **kw_plain).generate(prompts, params, use_tqdm=False)]
    row_steps.clear()
    llm = _llm(model, "always", spec, **kw)
    assert _stepwise(llm, prompts, params) == want
    assert row_steps and all(rows > n for rows, n in row_steps)  # verify steps ran as rows
    # the graphs are captured up to the policy's largest verify step: none is larger
    cfg = llm.engine.runner.config
    limit = decode_rows.max_verify_rows(cfg.speculative, cfg.scheduler.max_num_seqs,
                                        cfg.scheduler.max_num_batched_tokens)
    assert max(rows for rows, _ in row_steps) <= limit
    assert llm.stats.spec.spec_decode_num_accepted_tokens > 0
    if "kv_cache_memory" in kw:
        assert llm.engine.scheduler.num_preemptions > 0


class EagerGraphs:
    """Stands in for ``DecodeGraphs`` on the CPU: runs the decode rows it is handed eagerly, as
    a replay of the captured graph computes them, so the runner's graph branch is tested here."""

    def __init__(self, rt, max_batch: int, model=None, kv_layers=None):
        self.rt, self.max_batch, self.replays = rt, max_batch, []
        self.model, self.kv_layers = model or rt.model, kv_layers or rt.kv_cache.layers

    def fits(self, batch: int, width: int, rows: bool = False) -> bool:
        return batch <= self.max_batch

    def run(self, ids, positions, slots, seq_lens, tables, res=None, patch=None, rows=False):
        rt, n = self.rt, len(ids)
        self.replays.append((n, rows))
        # rows of one sequence share its table; only steps with such rows are flagged
        assert rows == (len({tuple(t) for t in tables.tolist()}) < n)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots), block_tables=torch.from_numpy(tables),
                                 seq_lens=seq_lens.tolist(), query_lens=[1] * n, query_start=list(range(n + 1)),
                                 block_size=rt.block_size, decode_rows=rows)
        rt.backend.prepare(meta, rt.device)
        with forward_context(ForwardContext(meta, self.kv_layers, rt.backend)):
            return self.model(torch.from_numpy(ids), torch.from_numpy(positions))


@pytest.mark.parametrize("spec, graph_rows", [(NGRAM, 16), (DRAFT, 12)], ids=["ngram", "draft_model"])
def test_verify_steps_take_the_graph_branch(spec, graph_rows):
    """The default choice ("graphs"): verify steps whose rows fit a graph replay it, as rows;
    larger ones run prefill-shaped; the draft model's steps replay its own graphs. Greedy output
    is the same as without drafts."""
    prompts = _prompts(5, 4)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(mode="never").generate(prompts, params, use_tqdm=False)]
    llm = _llm(mode="graphs", spec=spec)
    rt = llm.engine.runner
    rt.graphs = EagerGraphs(rt, graph_rows)  # four requests: some verify steps fit, some not
    verifies = []
    forward = rt._forward
    rt._forward = lambda ids, seqs, *a, **kw: (decode_rows.eligible(seqs) and verifies.append(len(ids))
                                               or forward(ids, seqs, *a, **kw))
    draft = llm.engine.speculator.draft
    if draft is not None:
        draft.graphs = EagerGraphs(rt, graph_rows, draft.model, draft.kv.layers)
    assert _stepwise(llm, prompts, params) == want
    assert any(rows and n > len(prompts) for n, rows in rt.graphs.replays)  # verify steps as rows
    if draft is not None:  # drafting steps, and catching up after a verify step as rows
        assert (len(prompts), False) in draft.graphs.replays
        assert any(rows and n > len(prompts) for n, rows in draft.graphs.replays)
    assert max(verifies) > graph_rows  # and larger ones, prefill-shaped
    assert llm.stats.spec.spec_decode_num_accepted_tokens > 0
