"""Structured outputs under async scheduling: a step launched ahead of grammar rows holds its
sampling until the matchers have the tokens of the step in flight. Outputs are checked by
libraries we did not write (jsonschema, json, re; xgrammar's own single-matcher fill for the
mask) and must be token for token what synchronous scheduling gives, in batches mixing
constrained and free rows, under preemption, with n > 1 and with aborts mid-flight."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from byte_tokenizer import build

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.structured import BitmaskFiller, StructuredCompiler
from tests.test_engine_faults import _inject_fault

S = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "n"]}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("byte_tokenizer")))


def _tiny(tok_dir, **kw):
    args = dict(tokenizer=tok_dir, device="cpu", dtype="float32", kv_cache_memory="16MiB", block_size=4,
                max_model_len=1024, show_progress=False)
    return LLM("dummy:tiny", **{**args, **kw})


def _count_held_samplings(llm) -> list[int]:
    """Counts the steps whose grammar rows' sampling was held for the step before them."""
    runner, held = llm.engine.runner, [0]
    real = runner.launch_sampling

    def counting():
        held[0] += runner._deferred is not None
        real()
    runner.launch_sampling = counting
    return held


def _no_leak(llm):
    eng = llm.engine
    eng.check_invariants()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def _check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)", text), text


def _mixed_batch(temperature=0.0):
    """Constrained rows of every form between free rows, each free row with its own length."""
    specs = [("json", S(json=SCHEMA)), ("free", None), ("regex", S(regex=REGEX)), ("choice", S(choice=CHOICES)),
             ("free", None), ("grammar", S(grammar=GRAMMAR)), ("json", S(json=SCHEMA)), ("free", None)]
    params = [SamplingParams(max_tokens=120 if so else 20 + 7 * i, temperature=temperature, structured_outputs=so,
                             ignore_eos=so is None) for i, (_, so) in enumerate(specs)]
    return [k for k, _ in specs], [f"mixed {i} {'x' * i}" for i in range(len(specs))], params


@pytest.mark.parametrize("pool", [dict(), dict(kv_cache_memory="80KiB", max_num_batched_tokens=32, decode_reserve=0)],
                         ids=["roomy", "preempting"])
def test_async_gives_the_synchronous_tokens(tok_dir, pool):
    kinds, prompts, params = _mixed_batch()
    sync = _tiny(tok_dir, async_scheduling=False, **pool)
    ref = [o.outputs[0] for o in sync.generate(prompts, params)]
    fast = _tiny(tok_dir, async_scheduling=True, **pool)
    held = _count_held_samplings(fast)
    got = [o.outputs[0] for o in fast.generate(prompts, params)]
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for kind, c in zip(kinds, got):
        if kind != "free":
            assert c.finish_reason == "stop"
            _check(kind, c.text)
    assert held[0] > 10  # grammar rows were looked past, step after step
    if pool:
        assert fast.engine.scheduler.num_preemptions > 0
    _no_leak(sync)
    _no_leak(fast)


def test_sampled_n_samples_match_and_validate(tok_dir):
    """n = 3 at temperature 1, seeded: the fork step is not looked past, the siblings' steps
    are; each sibling follows its own matcher and the outputs equal the synchronous ones."""
    params = [SamplingParams(n=3, seed=5 + i, max_tokens=200, temperature=1.0, structured_outputs=S(json=SCHEMA))
              for i in range(3)] + [SamplingParams(max_tokens=40, temperature=1.0, seed=9, ignore_eos=True)]
    prompts = ["forks a", "forks b", "forks c", "free"]
    ref = _tiny(tok_dir, async_scheduling=False).generate(prompts, params)
    fast = _tiny(tok_dir, async_scheduling=True)
    held = _count_held_samplings(fast)
    got = fast.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    texts = [c.text for o in got[:3] for c in o.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 3
    assert held[0] > 0
    _no_leak(fast)


def test_abort_and_stop_while_a_grammar_step_is_in_flight(tok_dir):
    """Requests aborted, or ended by their grammar, while the step after is in flight: the rows
    of that step are dropped and their matchers never move again; the others carry on."""
    llm = _tiny(tok_dir, async_scheduling=True)
    eng = llm.engine
    held = _count_held_samplings(llm)
    for i in range(6):
        eng.add_request(f"r{i}", f"abort {i}", SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                                                               structured_outputs=S(json=SCHEMA)))
    eng.add_request("c", "choice", SamplingParams(max_tokens=20, structured_outputs=S(choice=CHOICES)))
    texts, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                texts[o.request_id] = o.outputs[0].text
        steps += 1
        if steps in (3, 6):
            assert eng._inflight is not None  # the abort lands while a step is launched ahead
            eng.abort_request(f"r{steps}")
    assert set(texts) == {"r0", "r1", "r2", "r4", "r5", "c"}
    for rid in ("r0", "r1", "r2", "r4", "r5"):
        jsonschema.validate(json.loads(texts[rid]), SCHEMA)
    assert texts["c"] in CHOICES
    assert held[0] > 0
    _no_leak(llm)


def test_filler_matches_xgrammar_row_by_row(tok_dir):
    """The batch mask against xgrammar's own single-matcher fill: shared matchers (n draws)
    filled once, terminated matchers and unlisted rows left out, buffers reused in turn."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = 600  # wider than the tokenizer: padded rows, as a model's vocabulary may be
    comp = StructuredCompiler(tok, vocab, (tok.eos_token_id,))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    a, b, c = (comp.matcher(S(json=SCHEMA)) for _ in range(3))
    a.accept(enc('{"name": "ab'))
    b.accept(enc('{"name": "q", "n": -1'))
    done = comp.matcher(S(choice=CHOICES))
    assert done.accept(enc("red") + [tok.eos_token_id]) == len(enc("red")) + 1 and done.terminated
    filler = BitmaskFiller(vocab, torch.device("cpu"))
    for _ in range(3):  # both buffers, then the first again
        mask, rows = filler.start(7, [0, 2, 3, 4, 6], [a, b, b, done, c]).result()
        assert rows == [0, 2, 3, 6]
        for row, m in ((0, a), (2, b), (3, b), (6, c)):
            ref = xgr.allocate_token_bitmask(1, vocab)
            m.matcher.fill_next_token_bitmask(ref)
            assert torch.equal(mask[row], ref[0])
        assert not torch.equal(mask[0], mask[2]) and not torch.equal(mask[2], mask[6])
        a.accept(enc("c"))  # a moves: the next fill must see it


def test_a_failed_step_leaves_the_matchers_with_the_kept_tokens(tok_dir):
    """A step fails while the next is launched ahead holding its sampling: the failed step's
    tokens never reach the matchers, the step ahead is dropped, and stepping on gives exactly
    the tokens of an engine that never failed."""
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so)
              for so in (S(json=SCHEMA), S(regex=REGEX), S(grammar=GRAMMAR))]
    prompts = ["fault a", "fault b", "fault c"]
    ref = [o.outputs[0].token_ids for o in _tiny(tok_dir, async_scheduling=False).generate(prompts, params)]
    llm = _tiny(tok_dir, async_scheduling=True)
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    done = {}

    def step():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0]
    for _ in range(6):
        step()
    real = _inject_fault(eng)
    with pytest.raises(RuntimeError, match="injected fault"):
        for _ in range(2):
            step()
    eng.runner.launch = real
    while eng.has_unfinished_requests():
        step()
    assert [done[i].token_ids for i in range(3)] == ref
    for kind, i in (("json", 0), ("regex", 1), ("grammar", 2)):
        _check(kind, done[i].text)
    _no_leak(llm)


def test_queued_tokens_reach_the_matchers_as_fed_one_by_one(tok_dir):
    """Tokens queued in the step (``defer``) and fed by the fill give the masks of xgrammar's
    own matchers fed token by token, on random walks through the grammars; a stop token ends
    the grammar, a refused token leaves its row out and ends the output at the next token."""
    import random

    import xgrammar as xgr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = 600
    comp = StructuredCompiler(tok, vocab, (tok.eos_token_id,))
    specs = [S(json=SCHEMA), S(regex=REGEX), S(grammar=GRAMMAR), S(json=SCHEMA)]
    ours = [comp.matcher(s) for s in specs]
    refs = [xgr.GrammarMatcher(comp.compile(s)) for s in specs]
    filler = BitmaskFiller(vocab, torch.device("cpu"))
    rng = random.Random(7)
    rows = list(range(len(specs)))
    for step in range(40):
        live = [k for k in rows if not refs[k].is_terminated()]
        if not live:
            break
        mask, masked = filler.start(len(specs), live, [ours[k] for k in live]).result()
        assert masked == live
        for k in live:
            ref = xgr.allocate_token_bitmask(1, vocab)
            refs[k].fill_next_token_bitmask(ref)
            assert torch.equal(mask[k], ref[0]), (step, k)
            allowed = [t for t in range(vocab) if (int(ref[0, t // 32]) >> (t % 32)) & 1]
            t = rng.choice(allowed)
            assert refs[k].accept_token(t)
            assert ours[k].defer(t) == refs[k].is_terminated() == (t == tok.eos_token_id)
            if refs[k].is_terminated():
                assert ours[k].terminated and not ours[k].pending
    g = comp.matcher(S(choice=CHOICES))
    assert g.defer(tok.convert_tokens_to_ids("x")) is False  # refused, found at the fill
    mask, masked = filler.start(1, [0], [g]).result()
    assert masked == [] and g.refused
    assert g.defer(tok.convert_tokens_to_ids("r")) is True


def test_the_engine_thread_feeds_no_matcher(tok_dir, monkeypatch):
    """Under async scheduling a grammar row's token is fed to its matcher by the mask's fill
    on the filler's thread, never by the engine's step; the outputs still validate and are
    those of synchronous scheduling."""
    import threading

    import xgrammar as xgr
    kinds, prompts, params = _mixed_batch()
    ref = [o.outputs[0].token_ids for o in _tiny(tok_dir, async_scheduling=False).generate(prompts, params)]
    llm = _tiny(tok_dir, async_scheduling=True)
    fed_on: list[str] = []
    for cls, name in ((xgr.GrammarMatcher, "accept_token"), (xgr.BatchGrammarMatcher, "batch_accept_token")):
        real = getattr(cls, name)

        def spy(*a, _real=real, **kw):
            fed_on.append(threading.current_thread().name)
            return _real(*a, **kw)
        monkeypatch.setattr(cls, name, staticmethod(spy) if name.startswith("batch") else spy)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for kind, o in zip(kinds, outs):
        if kind != "free":
            _check(kind, o.outputs[0].text)
    assert fed_on and all(n.startswith("kvserve-bitmask") for n in fed_on), set(fed_on)
    _no_leak(llm)
