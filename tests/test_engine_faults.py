"""A failed step must not leave prefix-cache entries pointing at KV that was never written."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


def _inject_fault(eng):
    """From now on each step's work is queued and the fault shows when its results are read.
    Returns the real launcher, to put back."""
    real = eng.runner.launch

    def boom(out):
        real(out)

        def fail():
            raise RuntimeError("injected fault")
        return fail
    eng.runner.launch = boom
    return real


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_step_drops_prefix_cache_entries(async_scheduling):
    """(With async scheduling the next step was launched ahead on the failed one's tokens: it is
    dropped too, or the next call would complete it and raise again.)"""
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, async_scheduling=async_scheduling)
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(1, 70))}  # four full 16-token blocks get hashed
    eng.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0))
    real = _inject_fault(eng)
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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_decode_step_can_be_retried(async_scheduling):
    """A step fails mid-decode; the requests stay where that step found them (async: its
    placeholder tokens and counters rolled back, the step launched ahead dropped), so stepping on
    finishes them with exactly the tokens of an engine that never failed."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    ref = [o.outputs[0].token_ids for o in LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    eng = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, async_scheduling=async_scheduling).engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}

    def step():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    for _ in range(4):  # prefill and a few decode steps
        step()
    real = _inject_fault(eng)
    with pytest.raises(RuntimeError, match="injected fault"):
        for _ in range(2):  # (async: the step in flight was launched before the fault; the next one fails)
            step()
    eng.runner.launch = real
    assert eng._inflight is None
    for r in eng.scheduler.running:
        assert not r.token_pending and r.num_computed_tokens == len(r.all_token_ids) - 1
    while eng.has_unfinished_requests():
        step()
    assert [done[str(i)] for i in range(len(prompts))] == ref
