"""One streamed request to an OpenAI-compatible endpoint, timed on the client's clock.

    start ──► first output chunk (TTFT) ──► chunk ──► chunk ... ──► [DONE] (e2e)
                                      └ ITL: gaps between output chunks ┘
    TPOT = (e2e - TTFT) / (output_tokens - 1)

An "output chunk" is a choice chunk that carries text, or any choice chunk before the finishing
one (a server streaming a model without a tokenizer sends empty texts, one per token). A server
may pack several tokens into one chunk when the client lags, so ITL is per chunk and TPOT per
token. Token counts come from the usage chunk (stream_options.include_usage); a server without
it is counted one token per output chunk.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    input_len: int  # as generated (words or ids); prompt_tokens is the server's count
    expected_output_tokens: int
    start: float = 0.0  # perf_counter at send
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "error": self.error, "input_len": self.input_len,
                "prompt_tokens": self.prompt_tokens, "expected_output_tokens": self.expected_output_tokens,
                "output_tokens": self.output_tokens, "ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e,
                "start_s": self.start}


def _chunk_text(chunk: dict, chat: bool) -> tuple[bool, str]:
    """(is an output chunk, its text)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False, ""
    c = choices[0]
    text = ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""
    if chat and not text:
        return False, ""  # the role delta, or a finish-only chunk
    # Completions: every choice chunk carries tokens, text or not (a model without a tokenizer
    # has none, and a lagging stream may deliver its first tokens together with the finish).
    return True, text


async def send(client: httpx.AsyncClient, path: str, body: dict, result: RequestResult) -> RequestResult:
    """POST `body` with stream=true to `path`; fills `result` (never raises for HTTP or protocol errors)."""
    chat = path.endswith("chat/completions")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result.start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                is_output, text = _chunk_text(chunk, chat)
                if is_output:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    result.text += text
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - result.start
    if not result.output_tokens:
        result.output_tokens = chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "the stream ended without output"
    return result
