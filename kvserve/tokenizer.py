"""Tokenizers and chat templates, from transformers: GGUF metadata or a Hugging Face directory.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept under the cache
directory (``KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``) keyed by the file's identity.
"""
from __future__ import annotations

import hashlib
import os
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
