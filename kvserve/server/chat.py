"""POST /v1/chat/completions: the model's chat template applied here, then one engine request.

Streamed as OpenAI does: per choice a role delta first, then content deltas (and, with tools,
`tool_calls` deltas: see tool_parsers.py), `finish_reason` on that choice's last chunk
("tool_calls" when it chose to call any); a usage chunk (no choices) when asked; then `data: [DONE]`.
"""
from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server import streams as st
from kvserve.server import tool_parsers as tp
from kvserve.server import tools as tl
from kvserve.server.errors import sse_error
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from kvserve.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
)
from kvserve.server.state import OUTCOME, ServerState

_RENDERED = {"messages", "tools", "documents", "add_generation_prompt"}  # what the template is rendered with


def template_ids(tokenizer, messages: list[ChatMessage], tools: list[ChatTool] | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids, exactly as LLM.apply_chat_template builds them (so outputs match offline).
    Tools go to the model's template, or into a system-prompt section if it has no tool support;
    `template_kwargs` are extra variables for the template (chat_template_kwargs)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
    conv, tool_list = [m.as_template_dict() for m in messages], tl.tool_dicts(tools) if tools else None
    history_has_tools = any(m.role == "tool" or m.tool_calls for m in messages)
    if (tool_list or history_has_tools) and not tl.template_supports_tools(tokenizer):
        conv, tool_list = tl.fallback_messages(conv, tool_list), None
    extra = template_kwargs or {}
    # apply_chat_template's own arguments, and the names it renders the template with
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"} | _RENDERED
    for key in extra:
        if key in reserved or not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs.{key}", "is not a template variable that can be set "
                                      f"(reserved: {sorted(reserved)})")
    try:
        text = tokenizer.apply_chat_template(conv, tools=tool_list, add_generation_prompt=True, tokenize=False,
                                             **extra)
    except TemplateError as e:  # the template refused the conversation (raise_exception in it)
        raise InvalidRequestError("messages", f"the model's chat template refused them: {e}") from None
    except ValueError as e:  # transformers' own checks of the conversation (e.g. an empty one)
        raise InvalidRequestError("messages", str(e)) from None
    return tokenizer.encode(text, add_special_tokens=False)


def _parser(state: ServerState, tool_mode: str | None):
    """The reader of this request's tool calls, or None (tools off: the reply is all content)."""
    if tool_mode is None:
        return None
    if tool_mode != "auto":
        return tp.ForcedParser(tool_mode)
    name = state.config.tool_call_parser
    if name == "auto":
        name = tp.detect(getattr(state.engine.engine.tokenizer, "chat_template", None))
    return tp.PARSERS[name]()


def _finish_reason(reason: str | None, calls, tool_mode: str | None) -> str | None:
    """"tool_calls" when the model chose to call (auto, required); a call forced by name ends
    with "stop", as OpenAI reports it."""
    return "tool_calls" if calls and reason == "stop" and tool_mode in ("auto", "required") else reason


async def create(state: ServerState, req: ChatCompletionRequest, raw: Request):
    state.check_model(req.model)
    state.check_capacity()
    tool_mode = tl.mode(req)
    tl.check_messages(req)
    params = req.sampling_params(req.token_limit, req.engine_logprobs)
    if tool_mode not in (None, "auto"):
        if params.structured_outputs is not None:  # one would silently replace the other
            raise InvalidRequestError("tool_choice", "a forced tool call (required or named) cannot be combined "
                                      "with response_format, structured_outputs or guided_*")
        params.structured_outputs = StructuredOutputsParams(json=tl.forced_schema(req, tool_mode))
    ids = template_ids(state.engine.engine.tokenizer, req.messages, req.tools if tool_mode else None,
                       req.chat_template_kwargs)
    parser = _parser(state, tool_mode)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        streams = st.start(state.engine, rid, [ids], params, *state.request_scope(req, raw))
    except InvalidRequestError as e:  # the engine's checks use SamplingParams' names
        raise req.as_sent(e) from None
    k = req.top_logprobs or 0
    if req.stream:
        return StreamingResponse(_stream(state, req, rid, streams, k, raw, parser, tool_mode),
                                 media_type="text/event-stream")
    try:
        (out,) = await st.collect(streams, raw)
    except st.ClientGone:
        return Response(status_code=499)  # nginx's "client closed request"; counted by the app, read by nobody
    state.metrics.observe_finished(out)
    choices, tokenizer = [], state.engine.engine.tokenizer
    for c in out.outputs:
        content, calls = (c.text, []) if parser is None else tp.parse(parser, c.text, req.parallel_tool_calls)
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                                  finish_reason=_finish_reason(c.finish_reason, calls, tool_mode),
                                  logprobs=ChatLogprobs(content=st.chat_logprobs(c, 0, len(c.token_ids), k, tokenizer))
                                  if req.logprobs else None))
    return ChatCompletionResponse(id=rid, model=state.config.model_name, choices=choices, usage=st.usage([out]),
                                  kv_transfer_params=out.kv_transfer_params)


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, streams, k: int,
                  raw: Request, parser, tool_mode: str | None) -> AsyncIterator[str]:
    created, model = int(time.time()), state.config.model_name

    def chunk(choices, usage=None) -> str:
        return st.sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

    sent_chars: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    tokenizer = state.engine.engine.tokenizer
    tools = {i: tp.ToolStream(parser, req.parallel_tool_calls) for i in range(req.n)} if parser else {}
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
                # with tool parsing: one chunk per call delta, as OpenAI sends them
                pieces = [DeltaMessage(content=text or None)]
                if tools:
                    new, deltas = tools[c.index].update(c.text, c.finished)
                    pieces = ([DeltaMessage(content=new)] if new is not None else []) + \
                        [DeltaMessage(tool_calls=[d]) for d in deltas]
                    if not pieces and not c.finished:
                        continue  # held: maybe the start of a call; its logprobs go with what follows
                    pieces = pieces or [DeltaMessage()]
                ntok = len(c.token_ids)
                lp = ChatLogprobs(content=st.chat_logprobs(c, b, ntok, k, tokenizer)) if req.logprobs else None
                sent_chars[c.index], sent_toks[c.index] = len(c.text), ntok
                if c.finished:
                    done.add(c.index)
                reason = _finish_reason(c.finish_reason, tools and tools[c.index].num_calls, tool_mode)
                for j, delta in enumerate(pieces):
                    last = j == len(pieces) - 1
                    yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lp if j == 0 else None,
                                                 finish_reason=reason if last else None)])
            if out.finished:
                final = out
                state.metrics.observe_finished(out)
        if req.include_usage and final is not None:
            yield chunk([], st.usage([final]))
        yield st.DONE
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, then close
        raw.scope[OUTCOME] = "stream_error"  # the status line said 200; the count says this
        yield sse_error(e)
        yield st.DONE
