"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled and launched before step
N's tokens reach the host. It must change nothing a user sees.

The same random workload runs synchronously and with async scheduling, on a random Llama: greedy
and seeded sampling, EOS and stop tokens, ragged ``max_tokens``, shared prefixes (prefix-cache
hits), a KV pool small enough to preempt, a token budget small enough to chunk prompts, log-probs,
and requests that async scheduling must not run ahead of (``n > 1``, penalties, prompt
log-probs). Every output (tokens, log-probs, finish reasons) must be equal; after every step the
engine's invariants hold, no block hash covers a token still pending, and at the end the pool is
whole. The async run must actually have run ahead, or the comparison proves nothing.
"""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine import lookahead
from kvserve.engine.kv_cache_manager import hash_block
from kvserve.engine.request import PENDING_TOKEN


def _workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 512) for _ in range(rng.randint(8, 20))]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(1, 512) for _ in range(rng.randint(1, 40))]
        prompts.append({"prompt_token_ids": (shared + tail) if i % 3 == 0 else tail})
        kind = rng.random()
        kw = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.3, seed=1000 + i,
                  temperature=0.0 if rng.random() < 0.5 else rng.choice([0.7, 1.0]))
        if kind < 0.1:
            kw["stop_token_ids"] = [rng.randrange(1, 512) for _ in range(20)]
        elif kind < 0.2:
            kw["logprobs"] = 2
        elif kind < 0.25:
            kw["n"] = 2
        elif kind < 0.3:
            kw["repetition_penalty"] = 1.3
        elif kind < 0.33:
            kw["prompt_logprobs"] = 1
        params.append(SamplingParams(**kw))
    return prompts, params


def _check_hashes(engine):
    """Every block hash a running request holds covers known tokens and equals a fresh hash."""
    kv = engine.kv
    bs = kv.block_size
    for req in engine.scheduler.running:
        parent = b""
        for i, h in enumerate(req.block_hashes):
            tokens = req.all_token_ids[i * bs:(i + 1) * bs]
            assert PENDING_TOKEN not in tokens, (req.request_id, i)
            parent = hash_block(parent, kv.hash_extra, tokens)
            assert h == parent, (req.request_id, i)


def _engine(async_scheduling: bool = True, kv_memory: str = "64MiB", max_num_seqs: int = 8,
            max_num_batched_tokens: int = 64, decode_reserve: float | None = None):
    return LLM("dummy:tiny", device="cpu", dtype="float32", kv_cache_memory=kv_memory, block_size=4,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256,
               show_progress=False, async_scheduling=async_scheduling, decode_reserve=decode_reserve).engine


def _drain(eng) -> dict:
    """Step until every request is done, checking the invariants and block hashes after each
    step; returns the finished outputs by request id."""
    outs = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.check_invariants()
        _check_hashes(eng)
    assert not eng.has_unfinished_requests()
    return outs


def _run(async_scheduling: bool, seed: int, kv_memory: str):
    # the small pool keeps no decode reserve, so that it preempts
    eng = _engine(async_scheduling, kv_memory, max_num_seqs=6, max_num_batched_tokens=48,
                  decode_reserve=0 if kv_memory == "64KiB" else None)
    prompts, params = _workload(seed)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    ahead = 0
    advance = lookahead.advance

    def counting(cur):
        nonlocal ahead
        ahead += 1
        advance(cur)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lookahead, "advance", counting)
        outs = _drain(eng)
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks  # nothing leaked
    return outs, ahead, eng.scheduler.num_preemptions


def _summary(o):
    return [(c.token_ids, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, round(lp.logprob, 4)) for t, lp in d.items())
                                              for d in c.logprobs])
            for c in o.outputs], o.prompt_logprobs is not None


@pytest.mark.parametrize("seed,kv_memory", [(0, "64MiB"), (1, "64MiB"), (2, "64KiB"), (3, "64KiB")])
def test_async_scheduling_changes_no_output(seed, kv_memory):
    sync, ahead0, _ = _run(False, seed, kv_memory)
    asyn, ahead, preemptions = _run(True, seed, kv_memory)
    assert ahead0 == 0 and ahead > 0
    assert sorted(sync) == sorted(asyn) == [str(i) for i in sorted(range(24), key=str)]
    for rid in sync:
        assert _summary(asyn[rid]) == _summary(sync[rid]), rid
    if kv_memory == "64KiB":
        assert preemptions > 0  # the small pool did preempt under async scheduling


def test_abort_of_a_request_in_flight():
    """Aborting a request whose next step is already launched drops that step's token for it;
    the others go on and the pool ends whole."""
    eng = _engine()
    for i in range(4):
        eng.add_request(str(i), {"prompt_token_ids": [5 + i] * 9}, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng._inflight is not None and any(s.request.request_id == "1" for s in eng._inflight.out.scheduled)
    eng.abort_request("1")
    done = _drain(eng)
    assert sorted(done) == ["0", "2", "3"]
    assert all(len(o.outputs[0].token_ids) == 20 for o in done.values())
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_finished_request_in_a_step_that_cannot_look_ahead():
    """A request aborted while its next step is in flight, when that step cannot itself run
    ahead (another request samples with a penalty), is dropped from it like any other."""
    eng = _engine()
    eng.add_request("A", {"prompt_token_ids": [5] * 9}, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    eng.add_request("B", {"prompt_token_ids": [6] * 9},
                    SamplingParams(max_tokens=5, repetition_penalty=1.2, ignore_eos=True))
    eng.step()
    eng.abort_request("A")
    done = _drain(eng)
    assert sorted(done) == ["B"] and len(done["B"].outputs[0].token_ids) == 5
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_step_times_do_not_overlap():
    """Each step's recorded time is its own call's: with steps launched ahead the busy time
    still adds up to no more than the wall time."""
    import time
    eng = _engine()
    for i in range(8):
        eng.add_request(str(i), {"prompt_token_ids": [7 + i] * 5}, SamplingParams(max_tokens=30, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    wall = time.perf_counter() - t0
    assert eng.stats.busy_time <= wall * 1.01


def test_async_scheduling_defaults_to_the_device():
    """Unset, async scheduling follows the device (on for CUDA, off on the CPU, where a step
    computes before it returns); set, it is what was asked."""
    llm = LLM("dummy:tiny", device="cpu", kv_cache_memory="16MiB", show_progress=False)
    assert llm.engine.config.async_scheduling is False
    eng = LLM("dummy:tiny", device="cpu", kv_cache_memory="16MiB", show_progress=False, async_scheduling=True).engine
    assert eng.config.async_scheduling is True
