"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, with conversation state kept server-side (memory/responses_db.py).

A turn's prompt is the chat template over: its `instructions` (never inherited from earlier
turns, as in OpenAI's API), then every earlier turn's input and output items (followed back
through `previous_response_id`), then its own input. Earlier turns render to the same tokens
each time, so a continued conversation's prompt starts with the previous turn's prompt and the
prefix cache (and the KV tiers, across restarts) finds it: `usage.input_tokens_details.
cached_tokens` tells how much was reused. Every turn of a chain runs as the engine session named
by the chain's first response, so idle offload and session isolation follow the conversation.
With `memory`, the prompt is instead assembled under a token budget (memory/assembler.py).

A turn's stable prefix (the template's rendering of its instructions and tools, before the first
user or assistant message) is pinned in the prefix cache once the turn ends (engine/
prefix_pins.py), owned by the turn's response: a later request with the same instructions and
tools hits it however much other traffic passes, until every response holding it is deleted, the
pin TTL passes, or newer pins need the budget. A turn that is not stored (store: false, or a
stream its client left) pins nothing: nothing could release its pin.

Tools, structured outputs and sampling go through the chat machinery: the request is
translated into a ChatCompletionRequest, and errors are renamed back into this API's fields.
"""
from __future__ import annotations

import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kvserve.engine.async_engine import EngineDeadError
from kvserve.errors import InvalidRequestError
from kvserve.memory.responses_db import ResponseStore
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server import chat
from kvserve.server import streams as st
from kvserve.server import tool_parsers as tp
from kvserve.server import tools as tl
from kvserve.server.errors import APIError
from kvserve.server.responses_protocol import ResponsesRequest, call_item, check_calls, message_item, to_messages
from kvserve.server.responses_stream import stream_events
from kvserve.server.state import TENANT, ServerState

# Errors raised with the chat request's field names, renamed to this request's.
_RENAMES = ((r"^max_tokens\b", "max_output_tokens"), (r"^response_format\.json_schema\.schema", "text.format.schema"),
            (r"^response_format", "text.format"), (r"^(tools\[\d+\])\.function\.", r"\1."),
            (r"^tool_choice\.function\.", "tool_choice."), (r"^(messages|prompt)\b", "input"))


def _renamed(e: InvalidRequestError) -> InvalidRequestError:
    field = e.field
    for pat, rep in _RENAMES:
        field = re.sub(pat, rep, field)
    if field == e.field:
        return e
    return InvalidRequestError(field, e.message.replace(e.field, field), e.code)


def _chat_request(req: ResponsesRequest, messages) -> chat.ChatCompletionRequest:
    fmt = req.text.format if req.text else None
    rf = None
    if fmt is not None and fmt.type == "json_object":
        rf = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        for key in ("name", "schema_"):
            if getattr(fmt, key) is None:
                raise InvalidRequestError(f"text.format.{key.rstrip('_')}", "is required with type json_schema")
        rf = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
             for t in req.tools or []]
    try:
        return chat.ChatCompletionRequest.model_validate(dict(
            model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, response_format=rf, tools=tools or None, tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls))
    except ValidationError as e:  # a value this API allows and chat does not: say which
        err = e.errors()[0]
        raise InvalidRequestError("input", f"cannot be rendered: {err.get('msg')}") from None


def _usage(out) -> dict:
    p, c = len(out.prompt_token_ids), sum(len(x.token_ids) for x in out.outputs)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


class Turn:
    """One Responses request on its way through the engine: what the response object says about
    it, and what is stored when it ends."""

    def __init__(self, state: ServerState, store: ResponseStore, req: ResponsesRequest, tenant: str | None,
                 items: list[dict], memory_report: dict | None):
        self.state, self.store, self.req, self.tenant = state, store, req, tenant
        self.items, self.memory_report = items, memory_report
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.stable_ids: list[int] = []  # the prompt's stable prefix, pinned when the turn ends
        self.cache_salt: str | None = None

    def body(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None) -> dict:
        req, fmt = self.req, self.req.text.format if self.req.text and self.req.text.format else None
        choice = req.tool_choice
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.state.config.model_name, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
                else (choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "usage": usage,
                "metadata": req.metadata or {}, "store": req.store, "user": req.user}
        if self.memory_report is not None:
            body["memory"] = self.memory_report
        return body

    def finish(self, output: list[dict], out) -> dict:
        reason = out.outputs[0].finish_reason
        body = self.body("incomplete" if reason == "length" else "completed", output, _usage(out), reason)
        self.state.metrics.observe_finished(out)
        if not self.req.store:  # nothing kept: no pin either (only deleting the response would release it)
            return body
        self.store.put(self.id, self.tenant, self.req.previous_response_id, self.items, output, body)
        if self.stable_ids:  # queued behind the turn: its blocks are cached by now
            ids, salt, owner = self.stable_ids, self.cache_salt, self.id
            try:
                self.state.engine.call(lambda e: e.pin_prefix(ids, owner, salt))
            except EngineDeadError:
                pass  # the response stands; there is no cache left to pin in
        return body


def _stable_prefix(tok, messages, tools, ids: list[int]) -> list[int]:
    """The leading tokens of ``ids`` the template renders from its leading system/developer
    messages and ``tools`` alone: what every request with the same instructions and tools
    starts with. Empty if there are none, or the template cannot render them alone."""
    head = []
    for m in messages:
        if m.role not in ("system", "developer"):
            break
        head.append(m)
    if not head and not tools:
        return []
    try:
        alone = chat.template_ids(tok, head, tools)
    except Exception:  # a template that insists on a user turn: nothing to pin, nothing wrong
        return []
    n = 0
    for a, b in zip(alone, ids):
        if a != b:
            break
        n += 1
    return ids[:n]


def _conversation(store: ResponseStore, req: ResponsesRequest, tenant: str | None) -> tuple[list, str | None]:
    """(earlier turns as (id, input items, output items), the chain's first response id)."""
    if req.previous_response_id is None:
        return [], None
    chain = store.chain(req.previous_response_id, tenant)
    if chain is None:  # another tenant's id is as unknown as a made-up one: nothing leaks
        raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                       "previous_response_id", "previous_response_not_found")
    return chain, chain[0][0]


async def create(state: ServerState, store: ResponseStore, memory, req: ResponsesRequest, raw: Request):
    state.check_model(req.model)
    state.check_capacity()
    tenant = raw.scope.get(TENANT)
    tok = state.engine.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise InvalidRequestError("model", "this model has no chat template; use /v1/completions")
    items = req.items()
    chain, root = _conversation(store, req, tenant)
    history = [it for _, ins, outs in chain for it in ins + outs]
    check_calls(history, items)
    report = None
    if req.memory is not None:
        messages, report = await memory.assemble(state, tenant, req, chain, items)
    else:
        messages = to_messages(req.instructions, history + items)
    turn = Turn(state, store, req, tenant, items, report)
    creq = _chat_request(req, messages)
    try:
        tool_mode = tl.mode(creq)
        params = creq.sampling_params(creq.token_limit, None)
        if tool_mode not in (None, "auto"):
            if params.structured_outputs is not None:
                raise InvalidRequestError("tool_choice", "a forced tool call (required or named) cannot be "
                                          "combined with text.format")
            params.structured_outputs = StructuredOutputsParams(json=tl.forced_schema(creq, tool_mode))
        ids = chat.template_ids(state.engine.engine.tokenizer, creq.messages, creq.tools if tool_mode else None)
        session = state.session_key(tenant, root or turn.id)
        turn.cache_salt = state.cache_salt(tenant, None, root or turn.id)
        if req.memory is None:
            turn.stable_ids = _stable_prefix(tok, creq.messages, creq.tools if tool_mode else None, ids)
        streams = st.start(state.engine, turn.id, [ids], params, session, turn.cache_salt)
    except InvalidRequestError as e:
        raise _renamed(creq.as_sent(e)) from None
    parser = chat._parser(state, tool_mode)
    if req.stream:
        return StreamingResponse(stream_events(turn, streams, parser, raw), media_type="text/event-stream")
    try:
        (out,) = await st.collect(streams, raw)
    except st.ClientGone:
        return Response(status_code=499)
    c = out.outputs[0]
    content, calls = (c.text, []) if parser is None else tp.parse(parser, c.text, req.parallel_tool_calls)
    status = "incomplete" if c.finish_reason == "length" else "completed"  # the message was cut short
    output = [message_item(content or "", status)] if content is not None or not calls else []
    output += [call_item(k.id, k.function.name, k.function.arguments) for k in calls]
    return turn.finish(output, out)


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", "response_id", "response_not_found")


def register(app: FastAPI, state: ServerState, store: ResponseStore, memory) -> None:
    @app.post("/v1/responses")
    async def v1_responses(req: ResponsesRequest, raw: Request):
        return await create(state, store, memory, req, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request):
        body = store.get(response_id, raw.scope.get(TENANT))
        if body is None:
            raise _not_found(response_id)
        return body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        if not store.delete(response_id, raw.scope.get(TENANT)):
            raise _not_found(response_id)
        memory.forget(raw.scope.get(TENANT), response_id)  # what memory took from it goes too
        try:
            state.engine.call(lambda e: e.unpin(response_id))
        except EngineDeadError:
            pass
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, raw: Request, order: str = "desc", limit: int = 20,
                          after: str | None = None):
        items = store.input_items(response_id, raw.scope.get(TENANT))
        if items is None:
            raise _not_found(response_id)
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order", f"must be asc or desc, got {order!r}")
        if not 1 <= limit <= 100:
            raise InvalidRequestError("limit", f"must be an integer in [1, 100], got {limit}")
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidRequestError("after", f"{after!r} is not an item of this response")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
