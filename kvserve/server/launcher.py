"""`kvserve serve`: load the engine, print where it listens and its KV cache, run uvicorn.

SIGTERM/SIGINT go to uvicorn: it stops accepting, lets in-flight requests finish for up to
--shutdown-timeout seconds, cancels the rest (their streams close, their requests abort), then
the app's lifespan stops the engine thread; the process exits 0.
"""
from __future__ import annotations

import logging
import signal

from kvserve import envs
from kvserve.config import parse_size

log = logging.getLogger(__name__)


def serve(args, make_engine) -> int:
    import uvicorn

    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.server.app import build_app

    api_key = args.api_key if args.api_key is not None else envs.get(envs.KVSERVE_API_KEY)
    raw = str(args.max_request_bytes)
    max_bytes = int(raw) if raw.isdigit() else parse_size(raw, "max_request_bytes")  # bare number: bytes
    engine = make_engine(args)
    name = args.served_model_name or engine.model_name
    app = build_app(AsyncEngine(engine), name, api_key=api_key or None, max_request_bytes=max_bytes,
                    max_waiting=args.max_waiting)
    blocks, bs = engine.num_kv_blocks, engine.block_size
    gib = blocks * engine.runner.kv_bytes_per_block() / 2**30
    print(f"kvserve: serving {name!r} at http://{args.host}:{args.port}/v1 | KV cache: {blocks} blocks x {bs} "
          f"tokens = {blocks * bs} tokens, {gib:.3f} GiB | max_model_len {engine.max_model_len}"
          f"{' | API key required' if api_key else ''}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM handled this way is a
    # clean exit, so leave it a no-op handler to re-raise into and return 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(config).run()
    return 0
