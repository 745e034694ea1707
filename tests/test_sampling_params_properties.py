"""Property: any SamplingParams is either refused with an InvalidRequestError naming a field
whose value breaks the documented ranges (OpenAI's, written out again here), or accepted and
then run by the engine on dummy:tiny without error, giving back every KV block. The engine may
still refuse what only it can check (the context length, the KV pool, the vocabulary)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError

MAX_LEN = 48
VOCAB = 512  # dummy:tiny's
I32 = 2**31 - 1
# field: (kind, low, high, low excluded); "int?" also takes None.
RANGES = {
    "n": ("int", 1, 128, False),
    "max_tokens": ("int?", 1, I32, False),
    "min_tokens": ("int", 0, I32, False),
    "temperature": ("num", 0, 2, False),
    "top_p": ("num", 0, 1, True),
    "top_k": ("int", -1, I32, False),
    "min_p": ("num", 0, 1, False),
    "repetition_penalty": ("num", 0, 100, True),
    "presence_penalty": ("num", -2, 2, False),
    "frequency_penalty": ("num", -2, 2, False),
    "seed": ("int?", -2**63, 2**63 - 1, False),
    "logprobs": ("int?", 0, 20, False),
    "prompt_logprobs": ("int?", 0, 20, False),
}
ODD = [None, True, False, "1", 1.5, -0.0, 1e-40, 5e-324, math.nan, math.inf, -math.inf, 2**63, 2**64, -2**63 - 1,
       10**30, [1]]


def in_range(name, v) -> bool:
    kind, lo, hi, lo_open = RANGES[name]
    if v is None:
        return kind == "int?"
    if isinstance(v, bool) or not isinstance(v, int if kind.startswith("int") else (int, float)):
        return False
    return (lo < v if lo_open else lo <= v) and v <= hi


def valid(name):
    kind, lo, hi, lo_open = RANGES[name]
    small_hi = min(hi, 6) if name in ("n", "max_tokens", "min_tokens") else hi  # short runs
    inside = (st.integers(lo, small_hi) if kind.startswith("int")
              else st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=lo_open))
    edges = ([] if name == "n" else [hi]) + ([] if lo_open else [lo])  # n=128 runs long: in anything()
    return inside | st.sampled_from(edges)


def anything(name):
    _, lo, hi, _ = RANGES[name]
    return valid(name) | st.sampled_from([lo, hi, lo - 1, hi + 1]) | st.sampled_from(ODD)


stops = (st.none() | st.text(max_size=3) | st.lists(st.text(max_size=4), max_size=6)
         | st.text(min_size=250, max_size=260))
stop_ids = st.none() | st.lists(st.integers(-2, VOCAB + 2) | st.sampled_from([2**63, I32 + 1]), max_size=4)


def stop_ok(v) -> bool:
    s = [v] if isinstance(v, str) else v
    return s is None or (len(s) <= 4 and all(0 < len(x) <= 256 for x in s))


def stop_ids_ok(v) -> bool:
    return v is None or all(type(t) is int and 0 <= t <= I32 for t in v)


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", kv_cache_memory="16MiB", max_model_len=MAX_LEN, show_progress=False)


@st.composite
def sampling_kwargs(draw):
    """Half the time every field given is in range (so the engine runs it); else a few fields
    take any value."""
    kwargs = draw(st.fixed_dictionaries({}, optional={k: valid(k) for k in RANGES}))
    if draw(st.booleans()):
        kwargs |= draw(st.fixed_dictionaries({}, optional={**{k: anything(k) for k in RANGES}, "stop": stops,
                                                           "stop_token_ids": stop_ids}))
    return kwargs


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(kwargs=sampling_kwargs(), prompt_len=st.integers(1, 12))
def test_refused_naming_a_bad_field_or_run_to_the_end(llm, kwargs, prompt_len):
    bad = {k for k, v in kwargs.items() if k in RANGES and not in_range(k, v)}
    if not stop_ok(kwargs.get("stop")):
        bad.add("stop")
    if not stop_ids_ok(kwargs.get("stop_token_ids")):
        bad.add("stop_token_ids")
    mt, mn = kwargs.get("max_tokens", 16), kwargs.get("min_tokens", 0)
    if not bad & {"max_tokens", "min_tokens"} and mt is not None and mn > mt:
        bad.add("min_tokens")
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError as e:
        assert e.field in bad, (e, kwargs)
        assert str(e).startswith(f"{e.field}: must be")
        return
    assert not bad, (bad, kwargs)
    e = llm.engine
    free0 = e.kv.pool.num_free_blocks
    try:
        out = llm.generate({"prompt_token_ids": list(range(1, prompt_len + 1))}, params, use_tqdm=False)[0]
    except InvalidRequestError as err:  # what only the engine can check
        if err.field == "stop_token_ids":
            assert any(t >= VOCAB for t in params.stop_token_ids)
        else:
            assert err.field in ("max_tokens", "n") and params.max_tokens is not None
            assert prompt_len + params.max_tokens > MAX_LEN or err.field == "n" or "KV" in str(err)
        return
    finally:
        assert not e.has_unfinished_requests() and e.kv.pool.num_free_blocks == free0
    assert len(out.outputs) == params.n
    limit = params.max_tokens or MAX_LEN - prompt_len
    assert all(1 <= len(c.token_ids) <= limit for c in out.outputs)
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
