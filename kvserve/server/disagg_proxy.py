"""`kvserve disagg-proxy`: one OpenAI endpoint in front of a prefill instance and a decode
instance (``kvserve serve --kv-transfer-config`` with kv_producer / kv_consumer).

    client --POST /v1/completions, /v1/chat/completions--> proxy
      1. --> prefill: the same body with max_tokens=1, stream off, kv_transfer_params
             {"do_remote_decode": true}; its response's kv_transfer_params name the transfer
      2. --> decode: the client's body plus those kv_transfer_params; its response (streamed or
             not) goes back to the client as it comes

An error of either instance comes back with its own status and body (OpenAI's shape); an
instance that cannot be reached is a 502 in that shape. Other paths (``/v1/models``) go to the
decode instance. The client's Authorization header is passed on to both.
"""
from __future__ import annotations

import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.server.errors import error_response

log = logging.getLogger(__name__)

_PASSED_HEADERS = ("authorization", "content-type")


def build_proxy_app(prefill: str, decode: str, timeout: float = 600.0) -> FastAPI:
    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="kvserve disagg-proxy", lifespan=lifespan)

    def headers(raw: Request) -> dict:
        return {k: v for k, v in raw.headers.items() if k.lower() in _PASSED_HEADERS}

    def unreachable(which: str, url: str, e: Exception) -> JSONResponse:
        log.warning("%s instance %s: %s", which, url, e)
        return error_response(502, f"the {which} instance at {url} cannot be reached: {type(e).__name__}",
                              code="upstream_unreachable")

    def passed_on(r: httpx.Response) -> Response:
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def relay(raw: Request, path: str) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return error_response(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        try:
            r = await client.post(prefill + path, json=first, headers=headers(raw))
        except httpx.HTTPError as e:
            return unreachable("prefill", prefill, e)
        if r.status_code != 200:  # the client's request is bad (or the instance failed): its answer
            return passed_on(r)
        second = dict(body, kv_transfer_params=r.json().get("kv_transfer_params"))
        req = client.build_request("POST", decode + path, json=second, headers=headers(raw))
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return unreachable("decode", decode, e)
        if resp.status_code != 200 or not body.get("stream"):
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            return passed_on(resp)

        async def chunks():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the decode instance went away mid-stream
                msg = {"error": {"message": f"the decode instance stopped: {type(e).__name__}",
                                 "type": "server_error", "param": None, "code": "upstream_error"}}
                yield f"data: {json.dumps(msg)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await relay(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await relay(raw, "/v1/chat/completions")

    @app.get("/health")
    async def health():
        for which, url in (("prefill", prefill), ("decode", decode)):
            try:
                r = await client.get(url + "/health")
            except httpx.HTTPError as e:
                return unreachable(which, url, e)
            if r.status_code != 200:
                return passed_on(r)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(raw: Request):
        try:
            return passed_on(await client.get(decode + "/v1/models", headers=headers(raw)))
        except httpx.HTTPError as e:
            return unreachable("decode", decode, e)

    return app


def serve_proxy(args) -> int:
    import uvicorn
    uvicorn.run(build_proxy_app(args.prefill, args.decode, args.timeout), host=args.host, port=args.port,
                log_level=args.log_level)
    return 0
