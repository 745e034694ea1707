"""build_app(): the FastAPI app over one AsyncEngine.

    request ─► _Gate (ASGI: status counting, 401 key, 413 size) ─► route ─► ServerState checks
            (404 model, 429 queue) ─► chat / completions ─► AsyncEngine

With API keys set, /metrics needs one too unless `metrics_public`; /health answers everyone, but
says why the engine is unwell (exception text) only to a caller with a key. A request's key
decides its tenant (state.tenant_of): the owner of its sessions and, with prefix-cache
isolation, part of its cache salt. Given a function that builds the engine instead of an engine,
the app loads it on a thread at startup (loading.py) and answers 503 meanwhile: /health
{"status": "loading"}, API paths an OpenAI-shaped error.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import InvalidRequestError
from kvserve.memory.responses_db import ResponseStore
from kvserve.server import chat, completions, dashboard, embeddings, responses_api
from kvserve.server.errors import APIError, error_response, install_handlers, to_api_error
from kvserve.server.loading import start_loading
from kvserve.server.metrics import Metrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    check_session_id,
)
from kvserve.server.responses_memory import ServerMemory
from kvserve.server.state import AUTHORIZED, OUTCOME, TENANT, ServerConfig, ServerState, tenant_of

DISCONNECTED = 499  # nginx's "client closed request": the client left before the response ended
# Metric label per path; anything else counts as "other" so scanners cannot grow the label set.
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
              "/v1/embeddings": "embeddings", "/v1/responses": "responses",
              "/v1/models": "models", "/tokenize": "tokenize", "/detokenize": "detokenize"}


class _Gate:
    """Pure ASGI (so it also sees streamed responses): auth, body size, per-endpoint status counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg, path = self.state.config, scope["path"]
        headers = dict(scope["headers"])
        scope[TENANT], refusal = _authorize(cfg, headers)
        scope[AUTHORIZED] = refusal is None
        if path == "/health" or (path == "/metrics" and (cfg.metrics_public or refusal is None)):
            return await self.app(scope, receive, send)  # probes and scrapes are not API requests
        endpoint = _ENDPOINTS.get(path, "other")
        status, ended = [0], [False]

        async def send_counting(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                ended[0] = True
            await send(msg)

        try:
            if refusal is not None:
                return await error_response(401, refusal, code="invalid_api_key")(scope, receive, send_counting)
            size = headers.get(b"content-length")
            if size is not None and size.isdigit() and int(size) > cfg.max_request_bytes:
                return await error_response(413, f"The request body has {int(size)} bytes; the limit is "
                                            f"{cfg.max_request_bytes}.")(scope, receive, send_counting)
            if size is None and scope["method"] in ("POST", "PUT", "PATCH"):
                # No Content-Length (chunked upload): read up to the limit before routing.
                body, more = b"", True
                while more:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client went away mid-upload
                    body += msg.get("body", b"")
                    more = msg.get("more_body", False)
                    if len(body) > cfg.max_request_bytes:
                        return await error_response(413, f"The request body is over the limit of "
                                                    f"{cfg.max_request_bytes} bytes.")(scope, receive, send_counting)
                receive = _replay(body, receive)
            if not self.state.ready:
                return await error_response(503, "The model is still loading; retry shortly.", code="model_loading",
                                            headers={"Retry-After": "1"})(scope, receive, send_counting)
            try:
                await self.app(scope, receive, send_counting)
            except Exception as e:  # noqa: BLE001 - unexpected: a 500 here keeps the connection
                if status[0]:  # (Starlette's own handler re-raises, and the server drops it)
                    raise
                a = to_api_error(e)  # logs it with its traceback
                await error_response(a.status, a.message, a.param, a.code)(scope, receive, send_counting)
        finally:
            # A response that never ended lost its client (a dropped stream, an upload cut short).
            self.state.metrics.count(endpoint, scope.get(OUTCOME) or (status[0] if ended[0] else DISCONNECTED))


def _authorize(cfg: ServerConfig, headers: dict) -> tuple[str | None, str | None]:
    """(the caller's tenant, None) for a good key or when no key is needed, else (None, why not)."""
    if not cfg.api_keys:
        return None, None
    auth = headers.get(b"authorization", b"").decode("latin-1")
    given = auth[7:].encode("latin-1") if auth.lower().startswith("bearer ") else b""
    match = None
    for key in cfg.api_keys:  # every key compared, in constant time: no timing says which was close
        if hmac.compare_digest(given, key.encode()):
            match = key
    if match is None:
        return None, "Incorrect API key provided." if given else "Missing API key (Authorization: Bearer ...)."
    return tenant_of(match), None


def _replay(body: bytes, receive):
    """An ASGI receive that yields the already-read body once, then the client's own messages."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _level(given: list[str]) -> int:
    """The ``level`` query parameter of /sleep: absent (1), or exactly one of "1" and "2"."""
    if not given:
        return 1
    if len(given) > 1 or given[0].strip() not in ("1", "2"):
        shown = given[0] if len(given) == 1 else given
        raise InvalidRequestError("level", f"must be 1 or 2 (given once), got {shown!r:.50}")
    return int(given[0])


def build_app(engine: AsyncEngine | Callable[[], LLMEngine], served_model_name: str | Sequence[str] | None = None,
              api_key: str | Sequence[str] | None = None, max_request_bytes: int = 1 << 20, max_waiting: int = 1024,
              on_load_error: Callable[[BaseException], None] | None = None, prefix_cache_isolation: str = "none",
              metrics_public: bool = False, on_engine_dead: Callable[[BaseException], None] | None = None,
              tool_call_parser: str = "auto", embedding_pooling: str = "mean",
              responses_db: str = ":memory:", idle_sleep: float | None = None) -> FastAPI:
    """`engine`: an AsyncEngine (started by the lifespan), or a function building the LLMEngine, run
    on a thread at startup. `served_model_name`: one name or several (the first is the one responses
    carry); None: the engine's (state.default_names). `api_key`: one key or several (each its own
    tenant); None: open. `on_load_error` is called on the event loop if that function raises,
    `on_engine_dead` if the engine later fails for good (a device fault: see engine/faults.py); the
    launcher then shuts the server down and exits non-zero. `prefix_cache_isolation`: none, key or
    request (state.py). `tool_call_parser`: a name in tool_parsers.PARSERS, or "auto" (from the chat
    template); `embedding_pooling`: mean or last. `responses_db`: the SQLite file of stored responses
    and agent memory (":memory:": kept only while the process runs). `idle_sleep`: seconds without
    requests after which the engine sleeps (AsyncEngine; needs sleep mode), when the app builds the
    engine."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name or ())
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    cfg = ServerConfig(tuple(dict.fromkeys(names)), tuple(dict.fromkeys(keys)), max_request_bytes, max_waiting,
                       prefix_cache_isolation, metrics_public, tool_call_parser=tool_call_parser,
                       embedding_pooling=embedding_pooling)
    ready = engine if isinstance(engine, AsyncEngine) else None
    state = ServerState(None, cfg, Metrics(lambda: state.engine))
    if ready is not None:
        ready.on_dead = on_engine_dead
        state.set_engine(ready)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if ready is not None:
            ready.start()
        else:
            start_loading(state, engine, on_load_error, on_engine_dead, idle_sleep=idle_sleep)
        try:
            yield
        finally:
            if state.engine is not None:
                state.engine.shutdown()
                th = state.engine._thread
                if th is None or not th.is_alive():  # never beside a step still running
                    try:  # the GPU prefix cache to the KV tiers: a restart or another replica finds it
                        state.engine.engine.flush_kv_to_tiers()
                    except Exception:  # noqa: BLE001 - shutting down regardless
                        logging.getLogger(__name__).exception("flushing the KV cache to the tiers failed")

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.kvserve = state
    install_handlers(app)
    created = int(time.time())

    @app.post("/v1/completions")
    async def v1_completions(req: CompletionRequest, raw: Request):
        return await completions.create(state, req, raw)

    @app.post("/v1/chat/completions")
    async def v1_chat(req: ChatCompletionRequest, raw: Request):
        return await chat.create(state, req, raw)

    @app.post("/v1/embeddings")
    async def v1_embeddings(req: EmbeddingRequest):
        return await embeddings.create(state, req)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "max_model_len": state.engine.engine.max_model_len}

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": [card(name) for name in state.config.served_model_names]}

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes ("models/m.gguf")
    async def v1_model(model: str):
        state.check_model(model)
        return card(model)

    @app.get("/health")
    async def health(raw: Request):
        told = raw.scope.get(AUTHORIZED, False)  # the cause is for operators, not for anyone probing
        if state.load_error is not None:
            why = f": {state.load_error!r}" if told else ""
            return error_response(503, f"the model failed to load{why}", code="load_failed")
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        ae = state.engine
        if ae.healthy:
            return {"status": "ok"}
        why = ("engine failed: " + repr(ae.error) if ae.error else "engine not running") if told else "engine failed"
        return error_response(503, why, code="unhealthy")

    def _store():
        store = state.engine.engine.store
        if store is None:
            raise InvalidRequestError("kv_tiers", "no KV tiers are on: start with --cpu-kv-memory, --disk-kv-dir "
                                      "or --redis-url")
        return store

    @app.get("/v1/kv_tiers")
    async def kv_tiers():
        """Per-tier usage, hit rate, bytes moved, load/store time; load-or-recompute decisions."""
        return _store().snapshot()

    async def _known_session(raw: Request, session_id: str, then) -> None:
        """Run ``then(engine, id)`` on the engine thread if the caller owns a session of that
        id; else 404 (another key's session is as unknown as one that never was)."""
        _store()
        sid = state.session_key(raw.scope.get(TENANT), check_session_id(session_id))
        found = await asyncio.wrap_future(state.engine.call(
            lambda eng: sid in eng.sessions and (then(eng, sid) or True)))
        if not found:
            raise APIError(404, f"No session {session_id!r}: it has not finished a turn on this server, has "
                           "expired, or its KV has already left the GPU.", "session_id", "session_not_found")

    @app.post("/v1/sessions/{session_id}/pin")
    async def pin_session(session_id: str, raw: Request):
        await _known_session(raw, session_id, lambda eng, sid: eng.pin_session(sid, True))
        return {"session_id": session_id, "pinned": True}

    @app.delete("/v1/sessions/{session_id}/pin")
    async def unpin_session(session_id: str, raw: Request):
        await _known_session(raw, session_id, lambda eng, sid: eng.pin_session(sid, False))
        return {"session_id": session_id, "pinned": False}

    @app.post("/v1/sessions/{session_id}/offload")
    async def offload_session(session_id: str, raw: Request):
        """Move an idle session's KV out of the GPU now (its next turn loads it back)."""
        await _known_session(raw, session_id, lambda eng, sid: eng.offload_idle_sessions(force=True, only=sid))
        return {"session_id": session_id, "offload": "queued"}

    # -- sleep mode (vLLM's endpoints): behind the API key like every API path ---------------
    @app.post("/sleep")
    async def sleep(raw: Request):
        """Give the GPU memory back; refused (409) while requests run, a no-op while asleep."""
        level = _level(raw.query_params.getlist("level"))
        eng = state.engine
        done = await asyncio.wrap_future(eng.call(lambda e: (e.sleep(level), e.sleep_level)[1]))
        return {"is_sleeping": True, "level": done}

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        """Restore ?tags=weights&tags=kv_cache (none given: both); a no-op while awake."""
        tags = raw.query_params.getlist("tags") or None
        asleep = await asyncio.wrap_future(state.engine.call(lambda e: (e.wake_up(tags), e.is_sleeping())[1]))
        return {"is_sleeping": asleep}

    @app.get("/is_sleeping")
    async def is_sleeping():
        asleep, level = await asyncio.wrap_future(state.engine.call(lambda e: (e.is_sleeping(), e.sleep_level)))
        return {"is_sleeping": asleep, "level": level}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def tokenizer():
        eng = state.engine.engine
        if eng.tokenizer is None:
            raise InvalidRequestError("model", "this model has no tokenizer")
        return eng.tokenizer

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if req.messages is not None:
            ids = chat.template_ids(tokenizer(), req.messages)
        else:
            ids = tokenizer().encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        vocab = state.engine.engine.arch.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequestError("tokens", f"token ids must be in [0, {vocab})")
        return {"prompt": tokenizer().decode(req.tokens)}

    dashboard.register(app, state)
    responses_api.register(app, state, ResponseStore(responses_db), ServerMemory(responses_db))
    app.add_middleware(_Gate, state=state)
    return app
