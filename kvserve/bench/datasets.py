"""What the bench sends. A dataset is a list of sessions; a session is a list of turns sent one
after another (a turn waits for the previous reply). The random dataset has one turn per session.

- random: prompt length ~ U[input_len_min, input_len_max], output length ~ U[output_len_min,
  output_len_max] (integers, both ends included), drawn from `seed`. The output length is exact:
  requests carry max_tokens = that length and ignore_eos. A "words" prompt has that many words
  (the server's token count, reported in usage, differs by the tokenizer); a "token-ids" prompt
  has exactly that many ids, for models without a tokenizer (dummy:<preset>).
- multiturn: every session shares one system prompt (so a prefix cache can reuse it); each user
  turn has U[input_len_min, input_len_max] words, and the assistant's actual reply is appended
  to the history before the next turn.

Words come from the docstrings of standard-library modules: text shipped with Python, so no
download and the same text on every machine with the same Python.
"""
from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

_TEXT_MODULES = ("argparse", "collections", "json", "random", "statistics", "string", "textwrap",
                 "unittest", "subprocess", "logging", "pathlib", "functools", "itertools", "heapq")


@dataclass(frozen=True)
class Turn:
    output_len: int
    prompt: str | list[int] | None = None  # completions: text or token ids; None for chat turns
    user_message: str | None = None  # chat: the new user message (history lives in the session)
    input_len: int = 0  # words or ids in the prompt / user message, as generated


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    system_prompt: str | None = None


def corpus_words() -> list[str]:
    words: list[str] = []
    for name in _TEXT_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        words += [w for w in doc.split() if w.isprintable()]
    return words


def _words(rng: random.Random, words: list[str], n: int) -> str:
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(n))


def random_sessions(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    prompt_format: str, token_id_range: tuple[int, int], seed: int) -> list[Session]:
    rng, words = random.Random(seed), corpus_words()
    out = []
    for _ in range(num_requests):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        if prompt_format == "token-ids":
            prompt: str | list[int] = [rng.randrange(*token_id_range) for _ in range(n_in)]
        else:
            prompt = _words(rng, words, n_in)
        out.append(Session((Turn(n_out, prompt=prompt, input_len=n_in),)))
    return out


def multiturn_sessions(num_requests: int, num_turns: int, system_prompt_len: int, input_len: tuple[int, int],
                       output_len: tuple[int, int], seed: int) -> list[Session]:
    """ceil(num_requests / num_turns) sessions; the last one is cut so turns total num_requests."""
    rng, words = random.Random(seed), corpus_words()
    system = _words(rng, words, system_prompt_len) if system_prompt_len else None
    out, left = [], num_requests
    while left > 0:
        k = min(num_turns, left)
        turns = []
        for _ in range(k):
            n_in = rng.randint(*input_len)
            turns.append(Turn(rng.randint(*output_len), user_message=_words(rng, words, n_in), input_len=n_in))
        out.append(Session(tuple(turns), system_prompt=system))
        left -= k
    return out
