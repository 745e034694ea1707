"""build_app(): the FastAPI app over one AsyncEngine.

    request ─► _Gate (ASGI: status counting, 401 key, 413 size) ─► route ─► ServerState checks
            (404 model, 429 queue) ─► chat / completions ─► AsyncEngine

/health and /metrics bypass the key so probes and scrapers need no secret. Given a function that
builds the engine instead of an engine, the app loads it on a thread at startup (loading.py) and
answers 503 meanwhile: /health {"status": "loading"}, API paths an OpenAI-shaped error.
"""
from __future__ import annotations

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
from kvserve.server import chat, completions, embeddings
from kvserve.server.errors import error_response, install_handlers
from kvserve.server.loading import start_loading
from kvserve.server.metrics import Metrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from kvserve.server.state import ServerConfig, ServerState

_OPEN_PATHS = ("/health", "/metrics")
# Metric label per path; anything else counts as "other" so scanners cannot grow the label set.
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
              "/v1/embeddings": "embeddings",
              "/v1/models": "models", "/tokenize": "tokenize", "/detokenize": "detokenize"}


class _Gate:
    """Pure ASGI (so it also sees streamed responses): auth, body size, per-endpoint status counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        cfg, endpoint = self.state.config, _ENDPOINTS.get(scope["path"], "other")
        status = [0]

        async def send_counting(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        headers = dict(scope["headers"])
        try:
            if cfg.api_key is not None:
                auth = headers.get(b"authorization", b"").decode("latin-1")
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
                    msg = "Incorrect API key provided." if given else "Missing API key (Authorization: Bearer ...)."
                    return await error_response(401, msg, code="invalid_api_key")(scope, receive, send_counting)
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
            await self.app(scope, receive, send_counting)
        finally:
            self.state.metrics.count(endpoint, status[0] or "no_response")


def _replay(body: bytes, receive):
    """An ASGI receive that yields the already-read body once, then the client's own messages."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def build_app(engine: AsyncEngine | Callable[[], LLMEngine], served_model_name: str | Sequence[str] | None = None,
              api_key: str | None = None, max_request_bytes: int = 1 << 20, max_waiting: int = 1024,
              on_load_error: Callable[[BaseException], None] | None = None,
              tool_call_parser: str = "auto", embedding_pooling: str = "mean") -> FastAPI:
    """`engine`: an AsyncEngine (started by the lifespan), or a function building the LLMEngine, run
    on a thread at startup. `served_model_name`: one name or several (the first is the one responses
    carry); None: the engine's (state.default_names). `on_load_error` is called on the event loop if
    that function raises (the launcher shuts the server down). `tool_call_parser`: a name in
    tool_parsers.PARSERS, or "auto" (from the chat template); `embedding_pooling`: mean or last."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name or ())
    cfg = ServerConfig(tuple(dict.fromkeys(names)), api_key, max_request_bytes, max_waiting,
                       tool_call_parser=tool_call_parser, embedding_pooling=embedding_pooling)
    ready = engine if isinstance(engine, AsyncEngine) else None
    state = ServerState(None, cfg, Metrics(lambda: state.engine))
    if ready is not None:
        state.set_engine(ready)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if ready is not None:
            ready.start()
        else:
            start_loading(state, engine, on_load_error)
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

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                                            "max_model_len": state.engine.engine.max_model_len}
                                           for name in state.config.served_model_names]}

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return error_response(503, f"the model failed to load: {state.load_error!r}", code="load_failed")
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        ae = state.engine
        if ae.healthy:
            return {"status": "ok"}
        why = f"engine failed: {ae.error!r}" if ae.error else "engine not running"
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

    @app.post("/v1/sessions/{session_id}/pin")
    async def pin_session(session_id: str):
        _store()
        state.engine.call(lambda eng: eng.pin_session(session_id, True))
        return {"session_id": session_id, "pinned": True}

    @app.delete("/v1/sessions/{session_id}/pin")
    async def unpin_session(session_id: str):
        _store()
        state.engine.call(lambda eng: eng.pin_session(session_id, False))
        return {"session_id": session_id, "pinned": False}

    @app.post("/v1/sessions/{session_id}/offload")
    async def offload_session(session_id: str):
        """Move an idle session's KV out of the GPU now (its next turn loads it back)."""
        _store()
        state.engine.call(lambda eng: eng.offload_idle_sessions(force=True, only=session_id))
        return {"session_id": session_id, "offload": "queued"}

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

    app.add_middleware(_Gate, state=state)
    return app
