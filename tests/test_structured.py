"""Structured outputs and logit_bias, offline. Every output of a constrained request is checked by
a library we did not write (jsonschema, json, re) over many samples at temperature 1 on
dummy:tiny with a small byte-level tokenizer, and a few on the default model; constrained
requests leave the rest of the batch, async scheduling, preemption and the KV pool alone."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from byte_tokenizer import build

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.errors import InvalidRequestError

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {"type": "object", "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": -2.5, "maximum": 10},
        },
        "required": ["name", "age", "address", "ok"],
    },
    "array": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                         "y": {"const": "z"}}, "required": ["x", "y"]}},
    "recursive": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"v": {"type": "integer", "minimum": -5, "maximum": 5},
                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
                         {"type": "null"}]},
}
CHOICES = ["red", 'say "hi"', "back\\slash", "caf\u00e9 \u4e2d", "tab\there"]
S = StructuredOutputsParams


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("byte_tokenizer")))


def _tiny(tok_dir, **kw):
    args = dict(tokenizer=tok_dir, device="cpu", dtype="float32", kv_cache_memory="16MiB", block_size=4,
                max_model_len=2048, show_progress=False)
    return LLM("dummy:tiny", **{**args, **kw})


@pytest.fixture(scope="module")
def llm(tok_dir):
    return _tiny(tok_dir)


def _no_leak(llm):
    eng = llm.engine
    eng.check_invariants()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


def _all_stopped(outs):
    reasons = [c.finish_reason for o in outs for c in o.outputs]
    assert reasons == ["stop"] * len(reasons), reasons


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    outs = llm.generate([f"sample {i}" for i in range(24)],
                        SamplingParams(max_tokens=400, temperature=1.0, structured_outputs=S(json=schema)))
    _all_stopped(outs)
    for text in _texts(outs):
        jsonschema.validate(json.loads(text), schema)
    assert len(set(_texts(outs))) > 1  # sampled, not one forced string
    _no_leak(llm)


def test_json_text_spec_and_json_object(llm):
    outs = llm.generate(["a", "b", "c", "d"], SamplingParams(max_tokens=400, structured_outputs=S(
        json=json.dumps(SCHEMAS["array"]))))
    _all_stopped(outs)
    for text in _texts(outs):
        jsonschema.validate(json.loads(text), SCHEMAS["array"])
    # Any object: a random model's nesting has a long tail, so fixed seeds and a generous budget.
    outs = llm.generate([f"o {i}" for i in range(6)], [SamplingParams(seed=i, max_tokens=1000, structured_outputs=S(
        json_object=True)) for i in range(6)])
    _all_stopped(outs)
    assert all(isinstance(json.loads(t), dict) for t in _texts(outs))


@pytest.mark.parametrize("spec, allowed", [
    (S(regex=r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"), r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"),
    (S(regex=r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"), r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"),
    (S(choice=CHOICES), CHOICES),
    (S(grammar='root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'),
     r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)"),
])
def test_regex_choice_grammar(llm, spec, allowed):
    outs = llm.generate([f"p {i}" for i in range(16)], SamplingParams(max_tokens=100, structured_outputs=spec))
    _all_stopped(outs)
    texts = _texts(outs)
    bad = [t for t in texts if (t not in allowed if isinstance(allowed, list) else not re.fullmatch(allowed, t))]
    assert not bad, bad
    assert len(set(texts)) > 1


def test_n_samples_each_follow_their_own_matcher(llm):
    """n = 4: the siblings fork the parent's matcher at the first token and go their own ways;
    a seeded request is reproducible."""
    sp = SamplingParams(n=4, seed=11, max_tokens=400, structured_outputs=S(json=SCHEMAS["nested"]))
    a, b = llm.generate(["forks"], sp), llm.generate(["forks"], sp)
    _all_stopped(a)
    for text in _texts(a):
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    assert len(set(_texts(a))) > 1
    assert _texts(a) == _texts(b)
    _no_leak(llm)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["one two three", "the lazy dog", "0123"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = SamplingParams(max_tokens=400, temperature=1.0, structured_outputs=S(json=SCHEMAS["nested"]))
    mixed = llm.generate(["x", *prompts, "y"], [constrained, plain, plain, plain, constrained])
    assert [o.outputs[0].token_ids for o in mixed[1:4]] == alone
    for o in (mixed[0], mixed[4]):
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])


def test_async_scheduling_and_preemption_keep_the_grammar(tok_dir, llm):
    """Greedy constrained requests give the same outputs with async scheduling (no look-ahead
    past a constrained step) and in a pool so small that requests are preempted and recomputed
    (the matcher outlives the preemption)."""
    prompts = [f"request {i}" for i in range(8)]
    sp = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=S(json=SCHEMAS[k]))
          for k in ("nested", "array", "recursive", "any_of")] * 2
    ref = _texts(llm.generate(prompts, sp))
    for kw in (dict(async_scheduling=True), dict(kv_cache_memory="80KiB", max_num_batched_tokens=32, decode_reserve=0)):
        other = _tiny(tok_dir, **kw)
        outs = other.generate(prompts, sp)
        assert _texts(outs) == ref
        _no_leak(other)
        if "kv_cache_memory" in kw:
            assert other.engine.scheduler.num_preemptions > 0


def test_logit_bias_bans_and_forces(llm):
    prompt = "bias"
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    top = base[0]  # the greedy choice
    banned = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                   logit_bias={top: -100}))[0].outputs[0].token_ids
    assert top not in banned
    sampled = llm.generate([prompt] * 8, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True,
                                                        logit_bias={top: -100}))
    assert all(top not in c.token_ids for o in sampled for c in o.outputs)
    forced = llm.generate([prompt] * 4, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=0,
                                                       logit_bias={77: 100, 78: 0.5}))
    assert all(c.token_ids == [77] * 8 for o in forced for c in o.outputs)
    # Log-probs are the model's own, before the bias: a random model gives token 77 far less than 1.
    lps = [p[77].logprob for o in forced for c in o.outputs for p in c.logprobs]
    assert len(lps) == 32 and max(lps) < -1.0


def test_logit_bias_cannot_leave_the_grammar(llm):
    quote = llm.get_tokenizer().convert_tokens_to_ids("x")
    outs = llm.generate(["g"] * 4, SamplingParams(max_tokens=50, structured_outputs=S(regex="[0-9]{3}"),
                                                  logit_bias={quote: 100}))
    _all_stopped(outs)
    assert all(re.fullmatch("[0-9]{3}", t) for t in _texts(outs))


@pytest.mark.parametrize("make, field, words", [
    (lambda: S(), "structured_outputs", ["exactly one"]),
    (lambda: S(json={"type": "string"}, regex="a"), "structured_outputs", ["exactly one", "json", "regex"]),
    (lambda: S(json="{not json"), "structured_outputs.json", ["JSON"]),
    (lambda: S(json=[1]), "structured_outputs.json", ["schema"]),
    (lambda: S(json={"type": "object", "default": object()}), "structured_outputs.json", ["JSON values"]),
    (lambda: S(choice=[]), "structured_outputs.choice", ["non-empty"]),
    (lambda: S(choice=["a", 3]), "structured_outputs.choice", ["strings"]),
    (lambda: S(regex=""), "structured_outputs.regex", ["non-empty"]),
    (lambda: S(json_object=1), "structured_outputs.json_object", ["boolean"]),
    (lambda: SamplingParams(logit_bias={-1: 1.0}), "logit_bias", ["token ids", "-1"]),
    (lambda: SamplingParams(logit_bias={"5": 1.0}), "logit_bias", ["token ids"]),
    (lambda: SamplingParams(logit_bias={5: 100.5}), "logit_bias", ["[-100, 100]", "100.5"]),
    (lambda: SamplingParams(logit_bias={5: math.nan}), "logit_bias", ["[-100, 100]"]),
    (lambda: SamplingParams(logit_bias={5: math.inf}), "logit_bias", ["[-100, 100]"]),
    (lambda: SamplingParams(logit_bias={5: None}), "logit_bias", ["[-100, 100]"]),
    (lambda: SamplingParams(logit_bias=[5]), "logit_bias", ["map"]),
])
def test_bad_params_name_the_field(make, field, words):
    with pytest.raises(InvalidRequestError) as e:
        make()
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("spec, field, words", [
    (S(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "structured_outputs.json",
     ["not a valid JSON schema", "properties/a/type"]),
    (S(json={"type": "object", "required": "a"}), "structured_outputs.json", ["required"]),
    (S(json={"$ref": "#/$defs/missing"}), "structured_outputs.json", ["cannot be compiled", "missing"]),
    (S(json={"not": {"type": "string"}}), "structured_outputs.json", ["'not' at /", "cannot enforce"]),
    (S(json={"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}),
     "structured_outputs.json", ["'uniqueItems' at /properties/a"]),
    (S(json={"anyOf": [{"type": "integer"}, {"if": {"type": "string"}, "then": {"minLength": 3}}]}),
     "structured_outputs.json", ["'if' at /anyOf/1"]),
    (S(json={"allOf": [{"type": "string"}, {"type": "integer"}]}), "structured_outputs.json", ["'allOf' over several"]),
    (S(json={"$ref": "http://127.0.0.1:1/x.json"}), "structured_outputs.json", ["another document"]),
    (S(regex="a(b"), "structured_outputs.regex", ["cannot be compiled", "parenthesis"]),
    (S(regex="[z-a]"), "structured_outputs.regex", ["cannot be compiled"]),
    (S(grammar="root ::= undefined_rule"), "structured_outputs.grammar", ["cannot be compiled", "undefined_rule"]),
    (S(grammar="root ::= \"a"), "structured_outputs.grammar", ["cannot be compiled"]),
    (S(grammar="root ::= root"), "structured_outputs.grammar", ["matches no output"]),
    (S(grammar="root ::= a\na ::= root"), "structured_outputs.grammar", ["matches no output"]),
    (S(regex=r"[^\s\S]"), "structured_outputs.regex", ["matches no output"]),
])
def test_specs_that_do_not_compile_are_refused_at_admission(llm, spec, field, words):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)
    assert not llm.engine.has_unfinished_requests()
    _no_leak(llm)


def test_a_grammar_that_dead_ends_mid_output_stops_there(llm):
    """After "ab" this grammar allows nothing (x matches no string), though its first token is
    allowed: the output stops there on the stop token, instead of taking a token the grammar
    refuses."""
    spec = S(grammar='root ::= "ab" x\nx ::= x "z"')
    outs = llm.generate([f"p {i}" for i in range(8)], SamplingParams(max_tokens=12, structured_outputs=spec))
    assert _texts(outs) == ["ab"] * 8
    _all_stopped(outs)
    _no_leak(llm)


def test_a_dead_row_may_only_stop():
    """The mask of a row with nothing allowed gets its stop tokens' bits (31 and 63 are the sign
    bits of their int32 words), as xgrammar reads them; a live row is left as it is."""
    import xgrammar as xgr

    from kvserve.structured.grammar import allow_stop_where_dead

    class State:
        stop_token_ids = frozenset({2, 31, 63})
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[1, 2] = 5
    allow_stop_where_dead(mask, [0, 1], [State(), State()])
    logits = torch.zeros(2, 96)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=96)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2, 31, 63]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [64, 66]


def test_keywords_as_property_names_or_one_allof_are_kept(llm):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"allOf": [{"type": "boolean"}]}},
              "required": ["not", "if"], "$defs": {"uniqueItems": {"type": "string"}}}
    out = llm.generate(["x"], SamplingParams(max_tokens=24, temperature=0, structured_outputs=S(json=schema)))
    assert out[0].outputs[0].token_ids
    _no_leak(llm)


def test_logit_bias_ids_must_be_in_the_vocabulary(llm):
    for bad in (512, 2**63, 2**70):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, logit_bias={bad: 1.0}))
        assert e.value.field == "logit_bias" and "[0, 512)" in str(e.value)


def test_model_without_tokenizer_refuses_structured_outputs():
    llm = LLM("dummy:tiny", device="cpu", kv_cache_memory="4MiB", show_progress=False)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=S(regex="a")))
    assert e.value.field == "structured_outputs" and "tokenizer" in str(e.value)


def test_compiled_grammars_are_cached_by_spec(llm):
    c = llm.engine.structured
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    first = c.compile(S(json=schema))
    # Same schema, keys in another order and as JSON text: one entry.
    assert c.compile(S(json=json.dumps(dict(reversed(list(schema.items())))))) is first
    old, c.cache_size = c.cache_size, 2
    try:
        c.compile(S(regex="a+"))
        c.compile(S(regex="b+"))
        assert c.compile(S(json=schema)) is not first  # evicted by the two newer ones, compiled again
    finally:
        c.cache_size = old
    old, c.cache_bytes = c.cache_bytes, 1  # a byte budget: only the newest stays
    try:
        kept = c.compile(S(regex="c+"))
        assert c.compile(S(regex="c+")) is kept and len(c._cache) == 1
    finally:
        c.cache_bytes = old


def test_matcher_accepts_lists_and_rolls_back(llm):
    """The speculative-decoding contract: several tokens at once, stopping at the first refused,
    and rollback to any earlier point."""
    tok = llm.get_tokenizer()
    g = llm.engine.structured.matcher(S(regex="(ab)+c"))
    ids = [tok.convert_tokens_to_ids(ch) for ch in "ababx"]
    assert g.accept(ids) == 4  # "abab" accepted, "x" refused
    g.rollback(2)
    assert g.accept([ids[0], ids[1], tok.convert_tokens_to_ids("c")]) == 3
    eos = llm.engine.eos_token_ids[0]
    sibling = g.fork()
    assert g.accept([eos]) == 1 and g.terminated
    assert not sibling.terminated  # a fork moves on its own
    sibling.rollback(1)
    assert sibling.accept([tok.convert_tokens_to_ids("c")]) == 1


@pytest.mark.slow
def test_default_model_follows_a_schema():
    llm = LLM(show_progress=False, kv_cache_memory="256MiB")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "population", "capital"]}
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe Paris as JSON with city, population and capital."}],
        add_generation_prompt=True, tokenize=False)
    outs = llm.generate([prompt], SamplingParams(n=3, seed=3, max_tokens=80, temperature=1.0,
                                                 structured_outputs=S(json=schema)))
    _all_stopped(outs)
    for text in _texts(outs):
        jsonschema.validate(json.loads(text), schema)
