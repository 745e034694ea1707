"""A failed step must not leave prefix-cache entries pointing at KV that was never written."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


def test_failed_step_drops_prefix_cache_entries():
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False)
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(1, 70))}  # four full 16-token blocks get hashed
    eng.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0))
    real = eng.runner.launch

    def boom(out):  # the step's work was queued; the fault shows when its results are read
        real(out)

        def fail():
            raise RuntimeError("injected fault")
        return fail
    eng.runner.launch = boom
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.step()
    assert eng.kv.pool.num_cached_blocks == 0  # nothing can hit the unwritten blocks
    eng.runner.launch = real
    eng.abort_request("a")
    assert eng.kv.pool.num_used_blocks == 0
    # The engine still serves, and a fresh request computes its prompt instead of hitting.
    ref = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False).generate(
        prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0 and out.outputs[0].token_ids == ref
