"""`kvserve serve`: start uvicorn at once, load the engine on a thread meanwhile, run until a signal.

    t=0      listening: /health 503 {"status": "loading"}, API paths 503
    loaded   prints the KV cache size; /health 200
    failed   prints the cause, stops uvicorn, exits 2 (as a load error before serving did)

SIGTERM/SIGINT go to uvicorn: it stops accepting, lets in-flight requests finish for up to
--shutdown-timeout seconds, cancels the rest (their streams close, their requests abort), then
the app's lifespan stops the engine thread; the process exits 0.
"""
from __future__ import annotations

import logging
import signal
import sys

from kvserve import envs
from kvserve.config import parse_size

log = logging.getLogger(__name__)


def serve(args, make_engine) -> int:
    import uvicorn

    from kvserve.server.app import build_app

    api_key = args.api_key if args.api_key is not None else envs.get(envs.KVSERVE_API_KEY)
    raw = str(args.max_request_bytes)
    max_bytes = int(raw) if raw.isdigit() else parse_size(raw, "max_request_bytes")  # bare number: bytes
    failed: list[BaseException] = []
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

    app = build_app(load, args.served_model_name, api_key=api_key or None, max_request_bytes=max_bytes,
                    max_waiting=args.max_waiting, on_load_error=on_load_error,
                    tool_call_parser=args.tool_call_parser, embedding_pooling=args.embedding_pooling)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    print(f"kvserve: listening at http://{args.host}:{args.port}/v1; loading {args.model or 'the default model'} "
          f"(/health is 503 until it is ready){' | API key required' if api_key else ''}", flush=True)
    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM handled this way is a
    # clean exit, so leave it a no-op handler to re-raise into and return 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = uvicorn.Server(config)
    server.run()
    if failed:
        print(f"kvserve: error: the model failed to load: {failed[0]}", file=sys.stderr)
        return 2
    return 0
