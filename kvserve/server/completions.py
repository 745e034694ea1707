"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + i."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.errors import InvalidRequestError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import streams as st
from kvserve.server.errors import sse_error
from kvserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from kvserve.server.state import OUTCOME, ServerState


def _logprobs(c: CompletionOutput, start: int, end: int, k: int | None, offset: int) -> CompletionLogprobs | None:
    if k is None:
        return None
    lp = CompletionLogprobs()
    for tok, v, top in st.position_logprobs(c, start, end, k):
        lp.tokens.append(tok)
        lp.token_logprobs.append(v)
        lp.top_logprobs.append(dict(top))
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


async def create(state: ServerState, req: CompletionRequest, raw: Request):
    state.check_model(req.model)
    state.check_capacity()
    params = req.sampling_params(req.max_tokens, req.logprobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    try:
        streams = st.start(state.engine, rid, req.prompts(), params, *state.request_scope(req, raw))
    except InvalidRequestError as e:  # the engine's checks (a grammar compiles at admission) use its names
        raise req.as_sent(e) from None
    if req.stream:
        return StreamingResponse(_stream(state, req, rid, streams, raw), media_type="text/event-stream")
    try:
        outs = await st.collect(streams, raw)
    except st.ClientGone:
        return Response(status_code=499)  # nginx's "client closed request"; counted by the app, read by nobody
    choices = []
    for i, o in enumerate(outs):
        state.metrics.observe_finished(o)
        for c in o.outputs:
            choices.append(CompletionChoice(index=i * params.n + c.index, text=c.text,
                                            logprobs=_logprobs(c, 0, len(c.token_ids), req.logprobs, 0),
                                            finish_reason=c.finish_reason))
    return CompletionResponse(id=rid, model=state.config.model_name, choices=choices, usage=st.usage(outs))


async def _stream(state: ServerState, req: CompletionRequest, rid: str, streams,
                  raw: Request) -> AsyncIterator[str]:
    n = req.n
    created, model = int(time.time()), state.config.model_name
    sent_chars: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    has_text = state.engine.engine.tokenizer is not None  # without one, outputs have token ids only
    try:
        async for i, out in st.merge(streams):
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                a, b = sent_chars.get(idx, 0), sent_toks.get(idx, 0)
                text, ntok = c.text[a:], len(c.token_ids)
                # No new text: tokens held back (partial UTF-8) wait for their character; a model
                # without a tokenizer never has text, so each new token gets its (empty) chunk,
                # which keeps time-to-first-token measurable by clients (`kvserve bench serve`).
                if not text and not c.finished and (has_text or ntok == b):
                    continue
                choice = CompletionChoice(index=idx, text=text, finish_reason=c.finish_reason,
                                          logprobs=_logprobs(c, b, ntok, req.logprobs, a))
                sent_chars[idx], sent_toks[idx] = len(c.text), ntok
                if c.finished:
                    done.add(idx)
                yield st.sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
            if out.finished:
                finals[i] = out
                state.metrics.observe_finished(out)
        if req.include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield st.sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                            usage=st.usage(outs)))
        yield st.DONE
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, then close
        raw.scope[OUTCOME] = "stream_error"  # the status line said 200; the count says this
        yield sse_error(e)
        yield st.DONE
