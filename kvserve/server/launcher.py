"""`kvserve serve`: bind the port, start uvicorn, load the engine on a thread meanwhile, run until
a signal.

    bind     a port in use: one error line, exit 2, nothing loaded
    t=0      listening (printed once uvicorn serves the bound socket): /health 503 {"status":
             "loading"}, API paths 503
    loaded   prints the KV cache size; /health 200
    failed   prints the cause, stops uvicorn, exits 2 (as a load error before serving did)
    engine   a fault that stops the engine (engine/faults.py): /health 503, open requests get a
    dead     500, uvicorn stops, exits 3, so a supervisor restarts the server

SIGTERM/SIGINT go to uvicorn: it stops accepting and lets in-flight requests finish for up to
--shutdown-timeout seconds. Then the app ends what is still open in OpenAI's shape (a stream gets
an error event and [DONE], a plain request a 503) and aborts it in the engine, so every response
completes and nothing is cancelled mid-write; the lifespan stops the engine thread; exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvicorn

from kvserve import envs
from kvserve.config import parse_size

log = logging.getLogger(__name__)

# uvicorn's own deadline, past ours: by then every response has ended (it cancels what has not).
_UVICORN_GRACE_S = 5.0


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def app_kwargs(args) -> dict:
    """build_app's options from `kvserve serve`'s arguments (also each replica's, cluster/replica.py)."""
    keys = args.api_key if args.api_key is not None else [envs.get(envs.KVSERVE_API_KEY)]
    raw = str(args.max_request_bytes)
    max_bytes = int(raw) if raw.isdigit() else parse_size(raw, "max_request_bytes")  # bare number: bytes
    return dict(served_model_name=args.served_model_name, api_key=[k for k in keys if k] or None,
                max_request_bytes=max_bytes, max_waiting=args.max_waiting,
                prefix_cache_isolation=args.prefix_cache_isolation, metrics_public=args.metrics_public,
                tool_call_parser=args.tool_call_parser, embedding_pooling=args.embedding_pooling,
                responses_db=args.responses_db, idle_sleep=args.idle_sleep)


def serve(args, make_engine) -> int:
    from kvserve.server.app import build_app

    options = app_kwargs(args)
    api_key = options["api_key"]
    failed: list[BaseException] = []
    dead: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load():
        engine = make_engine(args)
        name = (args.served_model_name or [engine.model_name])[0]
        blocks, bs = engine.num_kv_blocks, engine.block_size
        gib = blocks * engine.kv_plan.block_bytes / 2**30
        print(f"kvserve: model {name!r} loaded | KV cache: {blocks} blocks x {bs} tokens = {blocks * bs} tokens, "
              f"{gib:.3f} GiB | max_model_len {engine.max_model_len}", flush=True)
        return engine

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    def on_engine_dead(e: BaseException) -> None:
        dead.append(e)
        server.should_exit = True

    app = build_app(load, on_load_error=on_load_error, on_engine_dead=on_engine_dead, **options)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + _UVICORN_GRACE_S, lifespan="on")
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"kvserve: error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2

    def started() -> None:
        print(f"kvserve: listening at http://{args.host}:{args.port}/v1; loading {args.model or 'the default model'} "
              f"(/health is 503 until it is ready){' | API key required' if api_key else ''}", flush=True)

    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM handled this way is a
    # clean exit, so leave it a no-op handler to re-raise into and return 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = _Server(config, started, app.state.kvserve.end_open_requests, args.shutdown_timeout)
    server.run(sockets=[sock])
    if failed:
        print(f"kvserve: error: the model failed to load: {failed[0]}", file=sys.stderr)
        return 2
    if dead:
        print(f"kvserve: error: the engine stopped: {dead[0]!r}; exiting for a restart", file=sys.stderr)
        return 3
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, telling when it serves and ending open requests at the deadline."""

    def __init__(self, config: uvicorn.Config, on_started, on_deadline, deadline_s: float):
        super().__init__(config)
        self.on_started, self.on_deadline, self.deadline_s = on_started, on_deadline, deadline_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.deadline_s, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
