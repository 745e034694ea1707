"""Ingress: the front end of a replicated kvserve, one Ray Serve deployment behind Ray's HTTP proxy.

Every HTTP request goes, as received, to one EngineReplica, whose app answers it exactly as the
single-process server would (auth, limits, validation, errors, streaming). The ingress only
chooses where, by a route key it derives from the body:

    /v1/completions, /v1/chat/completions   the prompt's tokens (chat: the template applied, as the
                                            replica will) -> chained block hashes; session_id
    /v1/sessions/{id}/...                   the session (sticky to the replica that holds it)
    anything else                           no key: the least-loaded replica

/health is the front end's own: 200 while at least one live replica reports itself healthy,
with the counts (until the first request builds the handle's router, which holds the reports,
one replica answers it, as it does any other path). /metrics goes to one replica, whose app
decides the key (and --metrics-public); allowed, its answer is replaced by every live replica's
metrics and the router's (metrics.py).

A body that does not parse gets no key; the replica it lands on answers the 400. Sessions and
salts are keyed by a hash of the caller's Authorization header, so one tenant's session or salt
never steers another's requests (the replica enforces the isolation itself).

Faults: a replica that dies before it answers is tried again once on another (nothing was sent
yet); one that dies mid-stream ends the stream with an OpenAI-shaped error event and [DONE].
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.cluster import metrics
from kvserve.cluster.prefix_index import block_hashes
from kvserve.cluster.reports import replica_reports
from kvserve.server.errors import APIError, error_body, sse_error
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
REPLICA_HEADER = b"x-kvserve-replica"  # which replica answered: for operators and tests
_DONE = b"data: [DONE]\n\n"


def _ray_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException
    return RayError, RayServeException


class Ingress:
    def __init__(self, replicas, tokenizer_source: tuple[str, str, str | None] | None, chat_template: str | None,
                 block_size: int, max_request_bytes: int):
        self.replicas = replicas.options(stream=True)
        self.block_size, self.max_request_bytes = block_size, max_request_bytes
        self.routed: dict[str, int] = {}  # replica id -> requests it started answering
        self.in_flight: dict[str, int] = {}  # replica id -> of those, not yet finished
        self.tokenizer = None
        if tokenizer_source is not None:
            from kvserve.tokenizer import load_tokenizer, read_chat_template
            self.tokenizer = load_tokenizer(*tokenizer_source)
            if self.tokenizer is not None and chat_template is not None:
                self.tokenizer.chat_template = read_chat_template(chat_template)

    # -- the route key ---------------------------------------------------------------------
    def route(self, path: str, body: bytes, authorization: bytes) -> dict | None:
        tenant = hashlib.sha256(authorization).hexdigest()[:16]
        if path.startswith("/v1/sessions/"):
            return {"session": f"{tenant}/{path.split('/')[3]}"}
        if path not in ROUTED_PATHS or not body or len(body) > self.max_request_bytes:
            return None
        try:
            tokens, req = self._prompt(path, json.loads(body))
        except Exception:  # noqa: BLE001 - any bad body: the replica names what is wrong
            return None
        salt = None if req.cache_salt is None else json.dumps([tenant, req.cache_salt])
        return {"hashes": block_hashes(tokens, self.block_size, salt), "num_tokens": len(tokens),
                "session": None if req.session_id is None else f"{tenant}/{req.session_id}"}

    def _prompt(self, path: str, body: dict):
        tok = self.tokenizer
        if path == "/v1/chat/completions":
            from kvserve.server.chat import template_ids
            req = ChatCompletionRequest.model_validate(body)
            return template_ids(tok, req.messages, None, req.chat_template_kwargs), req
        req = CompletionRequest.model_validate(body)
        p = req.prompts()[0]
        if isinstance(p, str):  # without a tokenizer the text's bytes stand in for tokens
            p = tok.encode(p) if tok is not None else list(p.encode())
        return p, req

    # -- the front end's own answers -----------------------------------------------------------
    def health(self) -> JSONResponse | None:
        if (seen := replica_reports()) is None:
            return None
        reports = seen[0]
        healthy = sum(1 for r in reports.values() if r.get("healthy"))
        if healthy:
            return JSONResponse({"status": "ok", "replicas": len(reports), "healthy_replicas": healthy})
        body = error_body(503, f"No replica is healthy ({len(reports)} live, none reporting healthy).",
                          code="unhealthy")
        return JSONResponse({**body, "replicas": len(reports), "healthy_replicas": 0}, status_code=503)

    def metrics(self) -> bytes:
        reports, decisions = replica_reports() or ({}, {})
        return metrics.render(reports, self.routed, self.in_flight, decisions)

    # -- forwarding -------------------------------------------------------------------------
    async def __call__(self, request: Request):
        if request.url.path == "/health" and request.method in ("GET", "HEAD") and (h := self.health()):
            return h
        body = await request.body()
        headers = [(k.lower(), v) for k, v in request.headers.raw]
        route = await asyncio.to_thread(self.route, request.url.path, body, request.headers.get("authorization",
                                                                                                 "").encode())
        call = (request.method, request.url.path, request.url.query.encode(), headers, body)
        errors = _ray_errors()
        for attempt in range(2):
            gen = self.replicas.handle.remote(*call, route=route)
            try:
                head = await gen.__anext__()
                break
            except StopAsyncIteration:
                return JSONResponse(error_body(500, "The replica sent no response."), status_code=500)
            except errors as e:
                log.warning("a replica failed before answering (attempt %d): %r", attempt + 1, e)
            except BaseException:  # the client left (Ray cancels this call): the replica aborts too
                gen.cancel()
                raise
        else:
            return JSONResponse(error_body(503, "No replica could answer; retry shortly.", code="replica_failed"),
                                status_code=503, headers={"Retry-After": "1"})
        replica = str(head["replica"])
        if request.url.path == "/metrics" and head["status"] == 200:  # the replica let the caller in
            gen.cancel()
            return Response(self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8",
                            headers={REPLICA_HEADER.decode(): replica})
        raw_headers = [(bytes(k), bytes(v)) for k, v in head["headers"]]
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in raw_headers)
        self.routed[replica] = self.routed.get(replica, 0) + 1
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        resp = StreamingResponse(self._body(gen, sse, replica), status_code=head["status"])
        resp.raw_headers = raw_headers + [(REPLICA_HEADER, replica.encode())]
        return resp

    async def _body(self, gen, sse: bool, replica: str):
        """The rest of the replica's response; a client that leaves cancels the replica's call,
        whose app then sees the disconnect and aborts the engine request (its KV is freed)."""
        done = False
        try:
            async for chunk in gen:
                yield chunk
            done = True
        except _ray_errors() as e:
            done = True
            if not sse:
                raise  # a plain body cut short: the connection closes, the client sees it incomplete
            log.warning("a replica failed mid-stream: %r", e)
            yield sse_error(APIError(503, "The replica serving this request stopped; retry the request.",
                                     code="replica_failed")).encode()
            yield _DONE
        finally:
            self.in_flight[replica] -= 1
            if not done:
                gen.cancel()
