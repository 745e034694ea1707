"""POST /v1/chat/completions: the model's chat template applied here, then one engine request.

Streamed as OpenAI does: per choice a role delta first, then content deltas, `finish_reason` on
that choice's last chunk; a usage chunk (no choices) when asked; then `data: [DONE]`.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.errors import InvalidRequestError
from kvserve.server import streams as st
from kvserve.server.errors import sse_error
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
)
from kvserve.server.state import ServerState

ENDPOINT = "chat_completions"


def template_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Prompt token ids, exactly as LLM.apply_chat_template builds them (so outputs match offline)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template([m.as_template_dict() for m in messages],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def create(state: ServerState, req: ChatCompletionRequest, raw: Request):
    state.check_model(req.model)
    state.check_capacity()
    params = req.sampling_params(req.token_limit, req.engine_logprobs)
    ids = template_ids(state.engine.engine.tokenizer, req.messages)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        streams = st.start(state.engine, rid, [ids], params, session_id=req.session_id)
    except InvalidRequestError as e:  # a grammar that does not compile is found at admission
        raise req.api_error(e) from None
    k = req.top_logprobs or 0
    if req.stream:
        return StreamingResponse(_stream(state, req, rid, streams, k), media_type="text/event-stream")
    try:
        (out,) = await st.collect(streams, raw)
    except st.ClientGone:
        state.metrics.count(ENDPOINT, "client_disconnected")
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    state.metrics.observe_finished(out)
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=ChatLogprobs(content=st.chat_logprobs(c, 0, len(c.token_ids), k))
                          if req.logprobs else None)
               for c in out.outputs]
    return ChatCompletionResponse(id=rid, model=state.config.model_name, choices=choices, usage=st.usage([out]))


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, streams, k: int) -> AsyncIterator[str]:
    created, model = int(time.time()), state.config.model_name

    def chunk(choices, usage=None) -> str:
        return st.sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

    sent_chars: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    final = None
    try:
        for i in range(req.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for _, out in st.merge(streams):
            for c in out.outputs:
                if c.index in done:
                    continue
                a, b = sent_chars.get(c.index, 0), sent_toks.get(c.index, 0)
                text = c.text[a:]
                if not text and not c.finished:
                    continue  # tokens held back (partial UTF-8): wait for the character
                ntok = len(c.token_ids)
                lp = ChatLogprobs(content=st.chat_logprobs(c, b, ntok, k)) if req.logprobs else None
                sent_chars[c.index], sent_toks[c.index] = len(c.text), ntok
                if c.finished:
                    done.add(c.index)
                yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=text or None), logprobs=lp,
                                             finish_reason=c.finish_reason)])
            if out.finished:
                final = out
                state.metrics.observe_finished(out)
        if req.include_usage and final is not None:
            yield chunk([], st.usage([final]))
        yield st.DONE
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, then close
        state.metrics.count(ENDPOINT, "stream_error")
        yield sse_error(e)
        yield st.DONE
