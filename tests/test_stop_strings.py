"""Incremental detokenization and stop strings with the default model's real tokenizer.

Token ids are fed one at a time the way ``OutputProcessor`` does it: append the token,
``Detokenizer.update``, then (once ``min_tokens`` is reached) ``find_stop``.
"""
from __future__ import annotations

import random

import pytest

from kvserve.engine.detokenizer import Detokenizer, find_stop
from kvserve.engine.output_processor import RequestState
from kvserve.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    from kvserve.models.loader import default_model_path
    from kvserve.tokenizer import load_tokenizer
    return load_tokenizer("gguf", default_model_path())


@pytest.fixture(scope="module")
def detok(tok):
    return Detokenizer(tok)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok, prompt_ids, out_ids, params: SamplingParams):
    """Returns (request, [output_text after each token], stop string or None, tokens fed)."""
    req = RequestState(0, list(prompt_ids), params)
    texts = []
    stop = None
    for t in out_ids:
        req.append_token(t)
        n = detok.update(req)
        texts.append(req.output_text)
        if req.num_output_tokens >= params.min_tokens:
            stop = find_stop(req, n)
            if stop is not None:
                texts[-1] = req.output_text
                break
    return req, texts, stop


TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 3:45 p.m., and 12.5% of 80 is 10!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\n",
    "I can 't do it . Really , yes -- \"quoted\" and 'single' ; done .",
    "naïve café résumé Ångström Straße façade ünïcödé",
    "😀😃🎉 你好世界 こんにちは 👨‍👩‍👧 🇯🇵 한국어 텍스트 Привет мир مرحبا",
    "数学：∑∫√∞≈≠ — “smart quotes” … € £ ¥ 🚀🔥💯",
    "   leading spaces and trailing   ",
]

PROMPTS = [
    "Write something:",
    "x",
    "Emoji at the end 😀🎉",  # the 5-token window before the output starts inside a character
    "中文提示词结尾你好",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_decode(tok, detok, prompt, text):
    prompt_ids = tok.encode(prompt)
    out_ids = enc(tok, text)
    req, texts, stop = feed(detok, prompt_ids, out_ids, SamplingParams())
    assert stop is None
    for i, got in enumerate(texts):
        so_far = tok.decode(out_ids[:i + 1], skip_special_tokens=True)
        assert REPLACEMENT not in got, (i, got)
        if REPLACEMENT not in so_far:
            assert got == so_far, i
        else:  # the tokens of an unfinished character wait; every whole token before them is out
            j = max(j for j in range(i + 2) if not tok.decode(out_ids[:j]).endswith(REPLACEMENT))
            assert got == tok.decode(out_ids[:j]), i
    assert req.output_text == tok.decode(out_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_random_tokens(tok, detok, seed):
    """Random (non-special) token ids: byte pieces that may not form valid UTF-8 at all."""
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [t for t in (rng.randrange(len(tok)) for _ in range(200)) if t not in special]
    # End on plain ASCII words so the final text has no unfinished character.
    ids += enc(tok, " the end.")
    req, texts, _ = feed(detok, enc(tok, "Prompt"), ids, SamplingParams())
    full = tok.decode(ids, skip_special_tokens=True)
    assert req.output_text == full
    for i, got in enumerate(texts):
        assert full.startswith(got), i


def test_special_tokens_skipped_or_kept(tok, detok):
    ids = enc(tok, "Hello") + [tok.eos_token_id] + enc(tok, " world")
    req, _, _ = feed(detok, enc(tok, "Hi"), ids, SamplingParams())
    assert req.output_text == "Hello world" == tok.decode(ids, skip_special_tokens=True)
    req, _, _ = feed(detok, enc(tok, "Hi"), ids, SamplingParams(skip_special_tokens=False))
    assert req.output_text == tok.decode(ids, skip_special_tokens=False) == f"Hello{tok.eos_token} world"


def test_multibyte_never_partial(tok, detok):
    text = "😀😃🎉 你好世界 こんにちは 👨‍👩‍👧 🇯🇵🚀"
    ids = enc(tok, text)
    # The test means something only if some tokens are pieces of a character.
    assert any(REPLACEMENT in tok.decode([t]) for t in ids)
    req = RequestState(0, enc(tok, "Say:"), SamplingParams())
    waited = 0
    for t in ids:
        req.append_token(t)
        n = detok.update(req)
        waited += n == 0
        assert REPLACEMENT not in req.output_text
        # What is out is whole characters of the text, in order.
        assert text.startswith(req.output_text)
    assert waited > 0
    assert req.output_text == text


# -- stop strings ------------------------------------------------------------------------------

def test_stop_string_spanning_tokens_is_cut(tok, detok):
    text = "The answer is 42. END OF ANSWER and more text after it."
    ids = enc(tok, text)
    stop = "END OF ANSWER"
    # It spans several tokens (" END", " OF", " AN", "SW", "ER").
    assert not any(stop in tok.decode([t]) for t in ids)
    req, texts, got = feed(detok, enc(tok, "Q:"), ids, SamplingParams(stop=[stop]))
    assert got == stop
    assert req.output_text == "The answer is 42. "
    # It stopped at the token that completed the stop string, not later.
    n_fed = len(texts)
    assert stop in tok.decode(ids[:n_fed]) and stop not in tok.decode(ids[:n_fed - 1])
    assert req.num_output_tokens == n_fed


def test_stop_string_kept_with_include_stop_str_in_output(tok, detok):
    text = "The answer is 42. END OF ANSWER and more text after it."
    ids = enc(tok, text)
    params = SamplingParams(stop="END OF ANSWER", include_stop_str_in_output=True)
    req, _, got = feed(detok, enc(tok, "Q:"), ids, params)
    assert got == "END OF ANSWER"
    assert req.output_text == "The answer is 42. END OF ANSWER"


def test_stop_string_ending_inside_a_token(tok, detok):
    ids = enc(tok, "Counting: 123456789 done")
    # "345" ends inside a digit run; the text is cut exactly at the stop string either way.
    req, _, got = feed(detok, enc(tok, "Go"), ids, SamplingParams(stop=["345"]))
    assert got == "345" and req.output_text == "Counting: 12"
    req, _, got = feed(detok, enc(tok, "Go"), ids, SamplingParams(stop=["345"], include_stop_str_in_output=True))
    assert got == "345" and req.output_text == "Counting: 12345"
    req, _, got = feed(detok, enc(tok, "Go"), enc(tok, "The answer is 42. END"),
                       SamplingParams(stop=["swer is 4"], include_stop_str_in_output=True))
    assert got == "swer is 4" and req.output_text == "The answer is 4"


def test_multibyte_stop_string(tok, detok):
    text = "Party time 🎉 and then 你好 more"
    ids = enc(tok, text)
    for stop, before in (("🎉", "Party time "), ("你好", "Party time 🎉 and then "), ("🎉 and", "Party time ")):
        req, texts, got = feed(detok, enc(tok, "Go"), ids, SamplingParams(stop=[stop]))
        assert got == stop and req.output_text == before
        assert all(REPLACEMENT not in t for t in texts)


def test_stop_string_in_prompt_is_ignored(tok, detok):
    req, _, got = feed(detok, enc(tok, "Please say END now"), enc(tok, " OK, done."), SamplingParams(stop=["END"]))
    assert got is None and req.output_text == " OK, done."


def test_earliest_stop_string_wins(tok, detok):
    ids = enc(tok, "Say hello world now")
    assert [tok.decode([t]) for t in ids] == ["Say", " hello", " world", " now"]
    # Both complete with " world"; "hello w" starts earlier in the text, whatever the list order.
    for stops in (["lo wor", "hello w"], ["hello w", "lo wor"]):
        req, texts, got = feed(detok, enc(tok, "Go"), ids, SamplingParams(stop=stops))
        assert got == "hello w" and req.output_text == "Say ", stops
        assert len(texts) == 3
    # One that completes earlier stops generation first, even if another would start earlier later.
    req, texts, got = feed(detok, enc(tok, "Go"), ids, SamplingParams(stop=["world now", "hello"]))
    assert got == "hello" and req.output_text == "Say " and len(texts) == 2
    # include_stop_str_in_output keeps the earliest one.
    req, _, got = feed(detok, enc(tok, "Go"), ids,
                       SamplingParams(stop=["lo wor", "hello w"], include_stop_str_in_output=True))
    assert got == "hello w" and req.output_text == "Say hello w"


def test_earliest_stop_string_wins_when_text_arrives_late(tok, detok):
    # Text held back by an unfinished character arrives in one piece with two stop strings in it.
    ids = enc(tok, "ab😀cd efg")
    req = RequestState(0, enc(tok, "Go"), SamplingParams(stop=["d e", "😀c"]))
    got = None
    for t in ids:
        req.append_token(t)
        got = find_stop(req, detok.update(req))
        if got:
            break
    assert got == "😀c" and req.output_text == "ab"


def test_stop_string_before_min_tokens_is_not_matched_later(tok, detok):
    """find_stop's contract: a stop string that appeared *in the text just added*. With two stop
    strings of different lengths, one that lies wholly in older text (emitted while min_tokens
    kept stop strings off, as the OutputProcessor does) must not be matched afterwards: that
    would cut the text back into the min_tokens part."""
    ids = enc(tok, "aX b c d e f g")
    params = SamplingParams(stop=["X", "A MUCH LONGER STOP STRING"], min_tokens=3, max_tokens=20)
    req, texts, got = feed(detok, enc(tok, "Go"), ids, params)
    assert got is None, f"matched {got!r} in pre-min_tokens text; output cut to {req.output_text!r}"
    assert req.output_text == "aX b c d e f g"


def test_no_stop_when_nothing_new(tok, detok):
    req = RequestState(0, enc(tok, "Go"), SamplingParams(stop=["a"]))
    req.output_text = "a"  # pre-existing text is not searched when no new chars arrived
    assert find_stop(req, 0) is None
