"""Load the model after the HTTP server is up, so probes see 503 "loading" instead of a closed port.

    lifespan start ─► thread "kvserve-load": make_engine()  (seconds to minutes: weights, KV pool)
                          │ ok:   loop.call_soon_threadsafe(install)  ─► AsyncEngine.start(), state.engine set
                          │ fail: loop.call_soon_threadsafe(fail)     ─► state.load_error set, on_error(e)
    until then: /health 503 {"status": "loading"}, API paths 503 (see app._Gate)

Invariant: `state.engine` is assigned on the event loop only, after AsyncEngine.start(), so a
request that sees it set finds a running engine thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.state import ServerState

log = logging.getLogger(__name__)


def start_loading(state: ServerState, make_engine: Callable[[], LLMEngine],
                  on_error: Callable[[BaseException], None] | None = None,
                  on_dead: Callable[[BaseException], None] | None = None,
                  idle_sleep: float | None = None) -> threading.Thread:
    """Build the engine on a daemon thread; call from inside the running event loop. ``on_dead``
    becomes the engine's ``AsyncEngine.on_dead``; ``idle_sleep`` its ``idle_sleep``."""
    loop = asyncio.get_running_loop()

    def install(engine: LLMEngine) -> None:
        try:
            ae = AsyncEngine(engine, idle_sleep=idle_sleep)
        except Exception as e:  # noqa: BLE001 - a bad option fails the start like a bad model
            fail(e)
            return
        ae.on_dead = on_dead
        ae.start()
        state.set_engine(ae)

    def fail(e: BaseException) -> None:
        state.load_error = e
        if on_error is not None:
            on_error(e)

    def work() -> None:
        try:
            engine = make_engine()
        except BaseException as e:  # noqa: BLE001 - reported through /health and on_error
            log.error("the model failed to load: %s", e, exc_info=e)
            callback, arg = fail, e
        else:
            callback, arg = install, engine
        try:
            loop.call_soon_threadsafe(callback, arg)
        except RuntimeError:  # the loop closed (shutdown during loading): nothing is left to tell
            pass

    t = threading.Thread(target=work, name="kvserve-load", daemon=True)
    t.start()
    return t
