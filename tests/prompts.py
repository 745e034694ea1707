"""Varied prompts for parity tests, built from text that ships with Python (not written here)."""
from __future__ import annotations

import codecs
import contextlib
import difflib
import io
import json
import textwrap

with contextlib.redirect_stdout(io.StringIO()):
    import this  # the Zen of Python, rot13-encoded in this.s (importing it prints it)

ZEN = codecs.decode(this.s, "rot13")
LONG_DOC = (textwrap.__doc__ or "") + (difflib.__doc__ or "") + (json.__doc__ or "")

RAW_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
    "Translate to French: I like apples. ->",
    ZEN[:300],
    "Résumé: naïve café — 東京 is the capital of",
    "Q: What is 12 times 12?\nA:",
]

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three primary colors.",
    "Summarize this text:\n" + ZEN,
]


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def parity_prompts(tokenizer) -> list[list[int]]:
    """At least 16 prompts, chat-templated and raw, from one token to well over 1,000."""
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [chat_prompt(tokenizer, q) for q in CHAT_QUESTIONS]
    doc = tokenizer.encode(LONG_DOC)
    prompts.append([doc[0]])  # a single token
    prompts.append(doc[:1100])  # over 1,000 tokens
    prompts.append(chat_prompt(tokenizer, "Summarize:\n" + tokenizer.decode(doc[:600])))
    assert len(prompts) >= 16 and max(map(len, prompts)) > 1000 and min(map(len, prompts)) == 1
    return prompts


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """Prompts sharing a long (multi-block) prefix, to exercise prefix caching."""
    prefix = "Read this document and answer.\n" + tokenizer.decode(tokenizer.encode(LONG_DOC)[:400])
    return [chat_prompt(tokenizer, prefix + "\n\nQuestion: " + q) for q in
            ("What is it about?", "Name one function.", "Who would use it?", "Is it long?")]
