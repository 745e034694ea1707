"""Tokenizers and chat templates, from transformers: GGUF metadata or a Hugging Face directory.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept under the cache
directory (``KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``) keyed by the file's identity.
"""
from __future__ import annotations

import codecs
import functools
import hashlib
import os
import re
import shutil

from kvserve import envs
from kvserve.errors import ConfigError, InvalidRequestError, ModelLoadError


def cache_dir() -> str:
    return envs.get(envs.KVSERVE_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")


def check_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode. JSON can carry a lone surrogate ("\\ud800"), which no
    tokenizer can encode: the request is refused rather than failing inside one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(field, f"is not valid Unicode: {e.reason} at character {e.start}") from None
    return text


def load_tokenizer(kind: str, path: str, tokenizer: str | None = None):
    """The tokenizer for a model source, or None (dummy weights, or a directory without one).
    transformers is imported only when there is a tokenizer to load: its import alone takes
    seconds of a start-up."""
    if tokenizer is not None:
        if tokenizer.endswith(".gguf"):
            return _from_gguf(tokenizer)
        return _from_pretrained(tokenizer)
    if kind == "gguf":
        return _from_gguf(path)
    if kind == "snapshot":
        path = os.path.join(path, "tokenizer")
        return _from_pretrained(path) if os.path.isdir(path) else None
    if kind == "hf":
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if any(os.path.exists(os.path.join(path, n)) for n in names):
            return _from_pretrained(path)
    return None


def _from_pretrained(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _from_gguf(path: str):
    from transformers import AutoTokenizer
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache entry is rebuilt below
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        if os.path.exists(cached):  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tok


def read_chat_template(value: str) -> str:
    """A chat template given as a file (vLLM's --chat-template) or as the Jinja text itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError("chat_template", f"{value!r} is neither a file nor a Jinja template")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, used by Llama 3, Qwen, SmolLM2...), character -> byte:
    the printable Latin-1 bytes stand for themselves, every other byte, in order, for the code
    points from 256 up."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 256
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenBytes:
    """Each token's raw bytes: the ``bytes`` of OpenAI's logprobs, and what text offsets count.
    A token may hold part of a UTF-8 character, which its decoded text shows as U+FFFD."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)  # (none: a slow one)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(tokenizer, "get_added_vocab", None)  # stored as text, not in the alphabet
        self.added = set(added().values()) if added is not None else set()
        self.pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        piece = self.pieces(token_id) if self.pieces is not None else None
        if isinstance(piece, str) and token_id not in self.added:
            if self.byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            m = None if self.byte_level else _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m[1], 16)])
            if not self.byte_level and "\u2581" in piece:  # SentencePiece's word boundary: a space
                return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def offsets(self, token_ids, start: int = 0) -> list[int]:
        """Where each token starts in the text they decode to, in characters from ``start``; a
        character split across tokens is counted at the token that completes it."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out, at = [], start
        for t in token_ids:
            out.append(at)
            at += len(decoder.decode(self(t)))
        return out


def token_bytes(tokenizer) -> TokenBytes | None:
    """The tokenizer's ``TokenBytes``, one per tokenizer (it caches what it looked up); None
    without a tokenizer that decodes (a model without one: tokens are ids)."""
    return None if not hasattr(tokenizer, "decode") else _token_bytes(tokenizer)


@functools.lru_cache(maxsize=8)
def _token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer)
