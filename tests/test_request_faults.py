"""A fault of one request (its sampling rows, seed generator, penalties, detokenization) aborts
that request alone: the others finish with the tokens they get when run alone, its KV blocks go
back to the pool, and the engine serves on. A device fault still stops the engine."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine import sampler as sampler_mod
from kvserve.engine.faults import RequestFailedError
from kvserve.engine.output_processor import OutputProcessor
from kvserve.errors import InvalidRequestError

BAD_PENALTY = 1.5  # the injected faults below pick out the request that uses it


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, max_model_len=128)


GOOD = [("seeded", [5, 6, 7, 8], SamplingParams(max_tokens=24, ignore_eos=True, seed=3, temperature=0.8)),
        ("greedy", [9, 10], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)),
        ("penalised", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, seed=9, frequency_penalty=0.5))]
BAD = SamplingParams(max_tokens=40, ignore_eos=True, seed=1, presence_penalty=BAD_PENALTY)


def _alone(llm) -> dict[str, list[int]]:
    return {rid: llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
            for rid, p, sp in GOOD}


def _run_with_bad(llm, bad_params=BAD, bad_steps_in: int = 2) -> tuple[dict, dict]:
    """The good requests and a bad one, the bad one added after ``bad_steps_in`` steps."""
    e = llm.engine
    free0 = e.kv.pool.num_free_blocks
    for rid, p, sp in GOOD:
        e.add_request(rid, {"prompt_token_ids": p}, sp)
    done: dict = {}
    for step in range(500):
        if step == bad_steps_in:
            e.add_request("bad", {"prompt_token_ids": [11, 12, 13]}, bad_params)
        if step > bad_steps_in and not e.has_unfinished_requests():
            break
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        e.check_invariants()
    failed = e.pop_failed()
    assert e.kv.pool.num_free_blocks == free0  # the aborted request's blocks came back
    assert not e.scheduler.groups and not e.output_processor.groups
    return done, failed


def _assert_only_bad_failed(done, failed, alone, cause_text):
    assert set(failed) == {"bad"} and isinstance(failed["bad"], RequestFailedError)
    assert cause_text in repr(failed["bad"].__cause__)
    assert "bad" not in done
    assert done == alone  # the others got exactly their tokens of a solo run


def _inject_penalty_fault(monkeypatch):
    """Penalties raise for any batch holding the bad request's row; returns the real function."""
    real = sampler_mod.apply_penalties

    def penalties(logits, rows):
        if any(r.presence_penalty == BAD_PENALTY for r in rows):
            raise ValueError("injected penalty fault")
        real(logits, rows)
    monkeypatch.setattr(sampler_mod, "apply_penalties", penalties)
    return real


def test_sampling_fault_aborts_only_its_request(llm, monkeypatch):
    alone = _alone(llm)
    real = _inject_penalty_fault(monkeypatch)
    done, failed = _run_with_bad(llm)
    _assert_only_bad_failed(done, failed, alone, "injected penalty fault")
    # The engine serves on, the penalties included.
    monkeypatch.setattr(sampler_mod, "apply_penalties", real)
    out = llm.generate({"prompt_token_ids": [11, 12, 13]}, BAD, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == BAD.max_tokens


def test_seed_generator_fault_aborts_only_its_request(llm, monkeypatch):
    alone = _alone(llm)
    e = llm.engine
    real_add = e.scheduler.add_request

    def add(req):
        if req.request_id == "bad":
            req.generators = [object()]  # not a generator: building its sampling row raises
        real_add(req)
    monkeypatch.setattr(e.scheduler, "add_request", add)
    done, failed = _run_with_bad(llm, bad_steps_in=0)
    _assert_only_bad_failed(done, failed, alone, "get_state")


def test_detokenizer_fault_aborts_only_its_request(llm, monkeypatch):
    alone = _alone(llm)
    real = OutputProcessor._apply

    def apply(self, state, co):
        if co.group_id == "bad" and state.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, state, co)
    monkeypatch.setattr(OutputProcessor, "_apply", apply)
    done, failed = _run_with_bad(llm)
    _assert_only_bad_failed(done, failed, alone, "injected")


def test_offline_generate_raises_and_leaves_nothing_running(llm, monkeypatch):
    _inject_penalty_fault(monkeypatch)
    free0 = llm.engine.kv.pool.num_free_blocks
    prompts = [{"prompt_token_ids": p} for _, p, _ in GOOD] + [{"prompt_token_ids": [4, 4]}]
    with pytest.raises(RequestFailedError, match="injected penalty fault"):
        llm.generate(prompts, [sp for _, _, sp in GOOD] + [BAD], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == free0


def test_device_fault_stops_the_step(llm, monkeypatch):
    def penalties(logits, rows):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(sampler_mod, "apply_penalties", penalties)
    e = llm.engine
    e.add_request("victim", {"prompt_token_ids": [1, 2]}, BAD)
    with pytest.raises(RuntimeError, match="CUDA error"):
        e.step()
    assert not e.pop_failed()  # not pinned on the request: the engine's caller sees it
    e.abort_request("victim")


def test_n_named_when_one_sequence_fits():
    small = LLM("dummy:tiny", kv_cache_memory="64KiB", show_progress=False, max_model_len=1024)
    blocks, bs = small.engine.num_kv_blocks, small.engine.block_size
    one = blocks * bs // 2  # one sequence of this length fits, eight do not
    with pytest.raises(InvalidRequestError) as ei:
        small.generate({"prompt_token_ids": [1] * 8}, SamplingParams(n=8, max_tokens=one), use_tqdm=False)
    assert ei.value.field == "n" and "n=8" in str(ei.value)
    with pytest.raises(InvalidRequestError) as ei:
        small.generate({"prompt_token_ids": [1] * 8}, SamplingParams(n=1, max_tokens=blocks * bs), use_tqdm=False)
    assert ei.value.field == "max_tokens"


def test_fault_under_async_scheduling():
    """With the next step launched before this one's tokens are known, the failed request is in
    both; it is aborted once and the other request's tokens are those of its solo run."""
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, async_scheduling=True)
    e = llm.engine
    sp = SamplingParams(max_tokens=20, ignore_eos=True, seed=3, temperature=0.8)
    alone = llm.generate({"prompt_token_ids": [1, 2, 3]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    free0 = e.kv.pool.num_free_blocks
    e.add_request("good", {"prompt_token_ids": [1, 2, 3]}, sp)
    e.add_request("bad", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=20, ignore_eos=True, seed=5))
    done, failures = {}, {}
    for step in range(100):
        if not e.has_unfinished_requests():
            break
        if step == 4:
            e.scheduler.groups["bad"][0].generators = [object()]
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        failures |= e.pop_failed()
        e.check_invariants()
    assert step >= 4 and set(failures) == {"bad"}  # the fault came mid-run
    assert done == {"good": alone}
    assert e.kv.pool.num_free_blocks == free0 and not e.pop_failed()
