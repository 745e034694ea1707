"""Plumbing shared by the completion endpoints: start requests, merge their output streams,
follow client disconnects, and turn engine outputs into OpenAI pieces (deltas, logprobs, usage).

Engine outputs are cumulative (whole text and token ids so far); each endpoint keeps, per choice,
how much it has sent and emits only the rest. The detokenizer holds back partial UTF-8, so a
text delta never splits a character.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from kvserve.engine.async_engine import AsyncEngine, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.responses import PromptTokensDetails, TokenLogprob, TopLogprob, Usage
from kvserve.tokenizer import token_bytes

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # non-streaming requests check for a gone client this often


class ClientGone(Exception):
    """The client closed the connection; its requests were aborted."""


def start(engine: AsyncEngine, base_id: str, prompts: Sequence, params: SamplingParams,
          session_id: str | None = None, cache_salt: str | None = None) -> list[RequestStream]:
    """Add one engine request per prompt; all or none (a bad prompt leaves nothing running)."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams.append(engine.add_request(base_id if len(prompts) == 1 else f"{base_id}-{i}", p, params,
                                              session_id=session_id if len(prompts) == 1 else None,
                                              cache_salt=cache_salt))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; leaving early closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer below
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """The final output of each stream; raises ClientGone (after aborting) if the client leaves."""
    async def drain() -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            last[i] = out
        return [last[i] for i in range(len(streams))]

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def usage(outs: Sequence[RequestOutput]) -> Usage:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)  # None: the engine did not say; report 0
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _token_str(lp, tok: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tok}"


def position_logprobs(c: CompletionOutput, start: int, end: int, k: int):
    """(token id, token, logprob, [(token id, token, logprob) top k by rank]) for output
    positions [start, end)."""
    # c.logprobs is appended to by the engine thread; token_ids is a copy, so bound by it.
    lps = c.logprobs or []
    for j in range(start, min(end, len(lps), len(c.token_ids))):
        tok, d = c.token_ids[j], lps[j]
        chosen = d[tok]
        top = sorted(d.items(), key=lambda kv: kv[1].rank)[:k]
        yield tok, _token_str(chosen, tok), chosen.logprob, [(t, _token_str(v, t), v.logprob) for t, v in top]


def chat_logprobs(c: CompletionOutput, start: int, end: int, k: int, tokenizer) -> list[TokenLogprob]:
    """OpenAI's chat logprobs; ``bytes``: each token's own bytes (part of a character, for some)."""
    tb = token_bytes(tokenizer)

    def raw(t: int, s: str) -> list[int]:
        return list(tb(t) if tb is not None else s.encode())
    return [TokenLogprob(token=s, logprob=lp, bytes=raw(tok, s),
                         top_logprobs=[TopLogprob(token=ts, logprob=v, bytes=raw(t, ts)) for t, ts, v in top])
            for tok, s, lp, top in position_logprobs(c, start, end, k)]


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


DONE = "data: [DONE]\n\n"
