"""The start-up warm-up (``engine/eager_warmup.py``, run on CUDA) writes only scratch blocks: an
engine that ran it decodes what one that did not decodes, with the requests' blocks reaching the
scratch ones, and both pools keep every block. It runs here on the CPU, called directly; whether
it leaves nothing to compile is checked on the GPU (``tests/test_cuda.py``)."""
from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine import eager_warmup

SPEC = {"method": "draft_model", "model": "dummy:tiny-draft", "num_speculative_tokens": 3}


def _engine(warm: bool, **kw) -> LLM:
    # A pool of 48 blocks: the prompts below hold most of it, the scratch blocks included.
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="384KiB", speculative_config=SPEC,
              enable_prefix_caching=True, **kw)
    if warm:
        rt, eng = llm.engine.runner, llm.engine
        n = eager_warmup.blocks_needed(rt.block_size)
        nb = eng.num_kv_blocks
        eager_warmup.warm_eager(rt, list(range(nb - n, nb)))
        d = eng.speculator.draft
        scratch = d.pool.allocate(n)
        eager_warmup.warm_eager(rt, scratch, model=(d.model, d.kv.layers))
        d.pool.free(scratch[::-1])
    return llm


def test_warmup_leaves_outputs_and_pools_as_they_were(caplog):
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 500, (35,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 500, (n,), generator=gen).tolist() for n in (1, 60, 140, 9, 200)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = {}
    for warm in (False, True):
        llm = _engine(warm)
        assert llm.engine.num_kv_blocks == 48
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # cached prefixes
        outs[warm] = [o.outputs[0].token_ids for o in got + again]
        eng = llm.engine
        assert eng.kv.pool.num_free_blocks == eng.num_kv_blocks
        d = eng.speculator.draft
        assert d.pool.num_free_blocks == d.pool.num_blocks and not d.tables
        assert all(o.num_cached_tokens >= 32 for o in again)
    assert outs[True] == outs[False]
    assert all(len(t) == 20 for t in outs[True])
    assert "not compiled" not in caplog.text  # every shape ran


def test_warmup_keeps_to_the_engines_context_length(caplog):
    """An engine of 40 positions runs only the shapes it could meet (positions past its RoPE
    tables would fail), and decodes as before."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in _engine(warm, max_model_len=40).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)] for warm in (False, True)]
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])
    assert "not compiled" not in caplog.text


def test_warmup_with_few_scratch_blocks_runs_the_shapes_that_fit(caplog, monkeypatch):
    """A pool smaller than ``blocks_needed`` (the draft model's as much as the target's) runs the
    shapes its scratch blocks hold and leaves out the rest, without an error."""
    ran = []
    llm = _engine(False)
    rt = llm.engine.runner
    real = rt._forward
    monkeypatch.setattr(rt, "_forward", lambda ids, seqs, **kw: (ran.append(len(seqs)), real(ids, seqs, **kw))[1])
    eager_warmup.warm_eager(rt, [0, 1, 2])
    assert 0 < len(ran) < len(eager_warmup.SHAPES + eager_warmup.DECODE_SHAPES)
    assert eager_warmup.blocks_needed(rt.block_size) > 3
    assert "not compiled" not in caplog.text
