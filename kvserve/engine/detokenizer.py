"""Incremental detokenization and stop-string matching.

Text is decoded over a sliding window (``prefix_offset`` .. end) so byte-level BPE pieces and
SentencePiece leading spaces come out right; a delta ending in U+FFFD is an unfinished UTF-8
character and waits for the next token. Stop strings are searched in the tail of the text, so a
match spanning several tokens is found, and cut off (kept with include_stop_str_in_output).
"""
from __future__ import annotations

from typing import Protocol

from kvserve.sampling_params import SamplingParams


class TextState(Protocol):
    """What the detokenizer reads and writes of a sequence (``output_processor.RequestState``)."""
    params: SamplingParams
    all_token_ids: list[int]
    output_text: str
    prefix_offset: int
    read_offset: int


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def update(self, req: TextState) -> int:
        """Extend ``req.output_text`` with the newest tokens; returns the number of chars added."""
        skip = req.params.skip_special_tokens
        toks = req.all_token_ids
        if skip and toks[-1] in self.special_ids:
            return 0
        prefix = self.tokenizer.decode(toks[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(toks[req.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            req.output_text += new
            req.prefix_offset, req.read_offset = req.read_offset, len(toks)
            return len(new)
        return 0


def find_stop(req: TextState, num_new_chars: int) -> str | None:
    """If a stop string appeared in the text just added, cut the text there and return it."""
    stops = req.params.stop_strings
    if not stops or num_new_chars == 0:
        return None
    text = req.output_text
    best = None
    for s in stops:
        # Only a match that ends in the new text counts: older text was checked before.
        idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    req.output_text = text[: idx + len(s)] if req.params.include_stop_str_in_output else text[:idx]
    return s
