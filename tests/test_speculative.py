"""Speculative decoding end to end: greedy output token-identical with and without drafts
(n-gram and draft model, through rejections, stops and preemption), sampled output distributed
as without drafts (chi-square), no KV block leaked, and every bad configuration refused."""
from __future__ import annotations

import random

import numpy as np
import pytest
from scipy import stats

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "model": "dummy:tiny-draft", "num_speculative_tokens": 3}
SKIP = {"method": "layer_skip", "draft_layers": 1, "num_speculative_tokens": 3}


def _tiny(spec=None, **kw):
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM("dummy:tiny", show_progress=False, speculative_config=spec, **kw)


def _prompts(seed=0, n=4):
    """Token prompts whose second half repeats the first, so lookup finds drafts; and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        unit = [rng.randrange(1, 512) for _ in range(rng.randrange(3, 20))]
        out.append(unit * 3 if i % 2 == 0 else [rng.randrange(1, 512) for _ in range(rng.randrange(2, 50))])
    return out


def _stepwise(llm, prompts, params):
    """Run to completion one step at a time, checking the KV pool's invariants after each."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        eng.check_invariants()
    assert eng.kv.pool.num_used_blocks == 0  # nothing leaked past the rejected drafts
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain():
    return _tiny()


@pytest.mark.parametrize("spec", [NGRAM, DRAFT, SKIP], ids=["ngram", "draft_model", "layer_skip"])
def test_greedy_output_is_token_identical(plain, spec):
    prompts = _prompts()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _tiny(spec)
    assert _stepwise(llm, prompts, params) == want
    s = llm.stats.spec
    assert s.spec_decode_num_drafts > 0 and s.spec_decode_num_accepted_tokens > 0
    assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    assert "mean acceptance length" in llm.stats.summary()
    if spec is not NGRAM:
        draft = llm.engine.speculator.draft
        assert draft.pool.num_used_blocks == 0
        # On the CPU the draft's projections are packed for oneDNN, as the target's are.
        assert draft.model.layers[0].mlp.down_proj.packed is not None


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_draft_changes_no_token(plain, method):
    """``speculative_config.quantization``: the draft's projections rounded at load; what it
    proposes moves, what is emitted does not."""
    from kvserve.layers.quant_linear import QuantLinear
    prompts = _prompts(seed=3)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _tiny({**DRAFT, "quantization": method})
    assert _stepwise(llm, prompts, params) == want
    down = llm.engine.speculator.draft.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.method == method
    assert llm.stats.spec.spec_decode_num_drafts > 0


def test_one_batch_of_greedy_requests_with_and_without_extras(plain, monkeypatch):
    """Plain greedy requests are verified from one batched argmax; a greedy request with
    penalties, a bias, log-probs or a min_tokens ban takes the per-request path. Mixed in one
    batch, each gives the tokens it gives without drafts."""
    from kvserve.engine.spec import rejection
    prompts = _prompts(3, 6)
    first = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)]
    base = dict(max_tokens=30, temperature=0, ignore_eos=True)
    params = [SamplingParams(**base), SamplingParams(**base, repetition_penalty=1.3),
              SamplingParams(**base, logit_bias={first[2][4]: -100.0}), SamplingParams(**base, logprobs=1),
              SamplingParams(max_tokens=30, temperature=0, min_tokens=12, stop_token_ids=[first[4][5]]),
              SamplingParams(**base)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    seen = []
    verify = rejection.verify_request
    monkeypatch.setattr(rejection, "verify_request", lambda *a: seen.append(1) or verify(*a))
    llm = _tiny(NGRAM)
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    done, per_request = {}, []
    while eng.has_unfinished_requests():
        n = len(seen)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        per_request.append(len(seen) - n)
        eng.check_invariants()
    assert [done[f"r{i}"] for i in range(len(prompts))] == want
    assert eng.kv.pool.num_used_blocks == 0
    assert llm.stats.spec.spec_decode_num_drafts > 0
    # Only the four requests with extras ever took the per-request path.
    assert 0 < max(per_request) <= 4


def test_rejections_and_stops_inside_the_accepted_run(plain):
    """Penalties make drafts wrong often (they change what is likely once a draft is counted);
    stop tokens and max_tokens cut inside a run of accepted drafts."""
    prompts = _prompts(1, 6)
    outs = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)]
    stop = [o[7] for o in outs[:2]]  # tokens the greedy run produces, so the stops fire
    params = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True, stop_token_ids=stop,
                            repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=3)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _tiny(NGRAM)
    assert _stepwise(llm, prompts, params) == want
    s = llm.stats.spec
    assert s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # some were rejected


def test_a_small_token_budget_cuts_drafts_first(plain):
    prompts = _prompts(4, 6)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _tiny(NGRAM, max_num_batched_tokens=9)  # six decoding requests with up to 4 drafts each
    assert _stepwise(llm, prompts, params) == want
    assert llm.stats.spec.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("spec", [NGRAM, SKIP], ids=["ngram", "layer_skip"])
def test_preempted_speculative_requests_resume_identically(plain, spec):
    prompts = _prompts(2, 8)
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # 48 blocks of 16 fp32 tokens: the eight requests cannot all hold their KV at once.
    llm = _tiny(spec, dtype="float32", kv_cache_memory=48 * 16 * 2 * 2 * 2 * 16 * 4, decode_reserve=0)
    assert llm.engine.num_kv_blocks == 48
    assert _stepwise(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.stats.spec.spec_decode_num_accepted_tokens > 0
    if spec is SKIP:
        assert llm.engine.speculator.draft.pool.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_sampled_tokens_follow_the_same_distribution(plain, spec):
    """Tokens 2 and 3 of 800 seeded requests with drafts against 800 without: a chi-square
    test of homogeneity over the tokens. logit_bias gives most of the mass to a few tokens the
    prompt repeats, so drafts are accepted and rejected alike."""
    prompt = [1, 2, 3, 4] * 4
    bias = {t: 6.0 for t in (1, 2, 3, 4, 5)}  # about 80% of the mass
    n = 800
    runs = []
    spec = {**spec, "disable_by_batch_size": 4096, "verify_token_budget": 1 << 16}
    if spec["method"] == "ngram":
        spec["prompt_lookup_min"] = 1
    for llm in (plain, _tiny(spec)):
        params = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, logit_bias=bias, seed=i)
                  for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        if llm is not plain:
            s = llm.stats.spec
            assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
            assert llm.engine.kv.pool.num_used_blocks == 0
    for pos in (1, 2):
        cats = [t if t in bias else -1 for t in range(6)]  # the biased tokens, the rest pooled
        table = np.array([[sum((o[pos] if o[pos] in bias else -1) == c for o in run) for c in sorted(set(cats))]
                          for run in runs])
        assert stats.chi2_contingency(table).pvalue > 1e-3, table


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_async_scheduling_looks_ahead_past_plain_steps_only(plain, spec, monkeypatch):
    """With async scheduling a step without drafts may have the next launched ahead; a step
    with drafts never does (its kept tokens are the next step's inputs). Both kinds run here:
    the engine tries each before the measured cheaper one takes over. Greedy output unchanged."""
    from kvserve.engine import lookahead
    looked, drafted_ahead = [], []
    advance = lookahead.advance

    def counting(step):
        looked.append(1)
        drafted_ahead.extend(s for s in step.out.scheduled if s.draft_token_ids)
        advance(step)
    monkeypatch.setattr(lookahead, "advance", counting)
    prompts = _prompts(5, 6)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _tiny(spec, async_scheduling=True)
    assert _stepwise(llm, prompts, params) == want
    assert looked and not drafted_ahead
    assert llm.stats.spec.spec_decode_num_drafts > 0


@pytest.mark.parametrize("spec, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2**63}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": float("nan")}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "dummy:tiny"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "dummy:smollm2-135m"}, "model"),  # vocab
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "draft_layers"),
    ({**SKIP, "draft_layers": 0}, "draft_layers"),
    ({**SKIP, "draft_layers": 2}, "draft_layers"),  # the target has 2 layers: none would be skipped
    ({**SKIP, "draft_layers": 2**63}, "draft_layers"),
    ({**SKIP, "draft_layers": "1"}, "draft_layers"),
    ({**SKIP, "draft_layers": None}, "draft_layers"),
    ({**SKIP, "model": "dummy:tiny-draft"}, "model"),
    ({**NGRAM, "draft_layers": 1}, "draft_layers"),
    ({**DRAFT, "quantization": "int3"}, "quantization"),
    ({**DRAFT, "quantization": 4}, "quantization"),
    ({**DRAFT, "quantization": ["int4"]}, "quantization"),
    ({**NGRAM, "quantization": "int8"}, "quantization"),
    ({**SKIP, "quantization": "int4"}, "quantization"),
])
def test_bad_config_names_the_field(spec, field):
    with pytest.raises(ConfigError, match=f"speculative_config.{field}"):
        _tiny(spec)


def test_draft_larger_than_target_is_refused():
    with pytest.raises(ConfigError, match="speculative_config.model.*larger"):
        LLM("dummy:tiny-draft", show_progress=False, kv_cache_memory="16MiB",
            speculative_config={**DRAFT, "model": "dummy:tiny"})


@pytest.mark.parametrize("kw, option", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"preemption_mode": "swap"}, "preemption_mode"),
    ({"cpu_kv_memory": "16MiB"}, "cpu_kv_memory"),
])
def test_unsupported_combinations_are_refused(kw, option):
    with pytest.raises(ConfigError, match=option):
        _tiny(NGRAM, **kw)
    with pytest.raises(ConfigError, match="speculative_config"):
        _tiny("ngram")  # not a dict


@pytest.mark.parametrize("params, field", [
    (SamplingParams(n=2), "n"),
    (SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
])
def test_unsupported_requests_are_refused(params, field):
    llm = _tiny(NGRAM)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert e.value.field == field
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_default_model_greedy_identical_with_layer_skip_drafts(model_path):
    """SmolLM2-135M drafting with its first 20 of 30 layers: drafts accepted and rejected, the
    output unchanged, the target's and the draft's KV all given back."""
    prompts = ["What is the capital of France?", "Copy this list: apples, pears, plums, cherries, grapes"]
    params = SamplingParams(max_tokens=24, temperature=0)
    want = [o.outputs[0].token_ids for o in LLM(model_path, show_progress=False, kv_cache_memory="256MiB").generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(model_path, show_progress=False, kv_cache_memory="256MiB",
              speculative_config={"method": "layer_skip", "draft_layers": 20, "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    s = llm.stats.spec
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert llm.engine.kv.pool.num_used_blocks == 0
    assert llm.engine.speculator.draft.pool.num_used_blocks == 0


@pytest.mark.slow
def test_default_model_greedy_identical_with_ngram_drafts(model_path):
    """SmolLM2-135M repeating text from its prompt: drafts are accepted, the output unchanged."""
    text = ("Copy this list exactly.\napples, pears, plums, cherries, grapes, lemons, limes\n"
            "apples, pears, plums, cherries, grapes, lemons, limes\napples,")
    params = SamplingParams(max_tokens=24, temperature=0)
    ref = LLM(model_path, show_progress=False, kv_cache_memory="256MiB")
    want = ref.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model_path, show_progress=False, kv_cache_memory="256MiB", speculative_config=NGRAM)
    got = llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert llm.stats.spec.spec_decode_num_accepted_tokens > 0
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_metrics_endpoint_and_request_errors():
    """/metrics carries the counters under vLLM's names; a request speculation cannot serve is a
    400 in OpenAI's shape naming the field."""
    import asyncio

    import httpx

    from kvserve.config import CacheConfig, EngineConfig, SpeculativeConfig
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app

    engine = LLMEngine(EngineConfig(model="dummy:tiny", cache=CacheConfig(kv_cache_memory=16 << 20),
                                    show_progress=False, speculative=SpeculativeConfig.from_dict(NGRAM)))

    async def run():
        ae = AsyncEngine(engine)
        app = build_app(ae, "tiny")
        ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7] * 6,
                                                          "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "n": 2})
                assert r.status_code == 400 and r.json()["error"]["param"] == "n"
                text = (await c.get("/metrics")).text
        finally:
            ae.shutdown()
        return text

    text = asyncio.run(asyncio.wait_for(run(), 60))
    s = engine.stats.spec
    assert s.spec_decode_num_accepted_tokens > 0
    assert f"kvserve_spec_decode_num_drafts_total {float(s.spec_decode_num_drafts)}" in text
    assert f"kvserve_spec_decode_num_accepted_tokens_total {float(s.spec_decode_num_accepted_tokens)}" in text
    assert 'kvserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert f"kvserve_spec_decode_mean_acceptance_length {s.mean_acceptance_length}" in text


def test_logprobs_are_the_targets_own(plain):
    prompts = _prompts(3, 2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = _tiny(NGRAM).generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) and b[t].rank == a[t].rank
