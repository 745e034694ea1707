"""Each token's raw bytes (OpenAI's logprob ``bytes``) and the text offsets counted from them:
joined over a text's tokens, the bytes are the text's UTF-8 (the encoding is the reference), for
a byte-level BPE vocabulary (the default model's) and a SentencePiece-style one with byte
fallback, on random text mixing ASCII, accents, CJK, emoji and combining marks."""
from __future__ import annotations

import random

import pytest

from kvserve.tokenizer import TokenBytes

ALPHABET = list("abc XYZ 019,.!?\n\t") + ["é", "ß", "日", "本", "語", "🎉", "𓀀", "\u0301", "Ω", "ñ"]


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def _sentencepiece_style():
    """A tiny BPE vocabulary with byte fallback and a word-boundary marker, as Llama 2 and Gemma
    have: characters outside it go out as <0xNN> pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["\u2581", "a", "b", "c", "\u2581a", "é", "日", "本"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_bytes_join_to_the_texts_utf8(kind, tokenizer):
    tok = tokenizer if kind == "byte_level" else _sentencepiece_style()
    tb = TokenBytes(tok)
    assert tb.byte_level == (kind == "byte_level")
    split = 0
    for text in _texts(200, seed=7):
        ids = tok.encode(text, add_special_tokens=False)
        parts = [tb(t) for t in ids]
        assert b"".join(parts) == text.encode(), (text, ids)
        offsets = tb.offsets(ids, start=5)
        assert offsets[0] == 5 and offsets == sorted(offsets)
        for t, b, o in zip(ids, parts, offsets, strict=True):
            try:
                whole = b.decode()
            except UnicodeDecodeError:
                split += 1
                continue
            assert text.startswith(whole, o - 5), (text, tok.convert_ids_to_tokens(t), o)
    assert split > 20  # the texts did split characters across tokens


def test_special_tokens_are_their_text(tokenizer):
    tb = TokenBytes(tokenizer)
    for name in ("<|im_start|>", "<|im_end|>"):
        assert tb(tokenizer.convert_tokens_to_ids(name)) == name.encode()
