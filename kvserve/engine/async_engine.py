"""AsyncEngine: LLMEngine behind asyncio, with the step loop on its own thread.

    event loop (server)                         engine thread (owns LLMEngine)
    add_request: tokenize + validate  ──cmd──►  drain commands ─► engine.step() ─► outputs
    RequestStream (asyncio.Queue)     ◄──────   loop.call_soon_threadsafe(queue.put_nowait, out)

Invariants:
- Only the engine thread touches the LLMEngine's mutable state (scheduler, KV, runner). The
  event loop only tokenizes and validates (read-only) and reads `snapshot`, which the engine
  thread replaces whole (never mutates) after every drain and every step.
- Commands are drained before each step, so an abort frees the request's KV blocks before the
  next step runs: within one step of the client going away.
- Every stream ends with a finished output or an exception. A fault of one request (``faults``)
  ends its stream with RequestFailedError and the engine serves on; any other fault in step()
  gives every open stream EngineDeadError, refuses new requests and calls ``on_dead`` (the
  server then exits for a supervisor to restart it), so no waiter hangs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.engine.llm_engine import LLMEngine, PromptType, check_cache_salt
from kvserve.engine.stats import SpecDecodingStats
from kvserve.errors import ConfigError, EngineBusyError, InvalidRequestError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_CALLERS_ERRORS = (InvalidRequestError, ConfigError, EngineBusyError)  # answered as 4xx, not faults

_IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on the command queue before rechecking


class EngineDeadError(RuntimeError):
    """The engine thread hit an exception in step(); the server maps this to 500."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the last drain or step, for metrics and admission (429)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_pinned: int = 0
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    kv_waste: float = 0.0
    prompt_tokens: int = 0  # cumulative, computed (prefix-cache hits excluded)
    generation_tokens: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found there
    spec_decode: SpecDecodingStats | None = None  # a copy, with speculative decoding on


class RequestStream:
    """Outputs of one request, in order. Iterating it to the end, or leaving early (break,
    cancellation, close()), always leaves the engine without the request."""

    def __init__(self, request_id: str, owner: AsyncEngine):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:  # event-loop thread only
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                # Outputs are cumulative: when the consumer lags, only the newest one matters.
                while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
                    item = self._queue.get_nowait()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
        self._owner._streams.pop(self.request_id, None)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_sleep: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``idle_sleep``: seconds without requests after which the engine sleeps (level 1;
        needs sleep mode); a request arriving while it sleeps wakes it (LLMEngine.add_request)."""
        if idle_sleep is not None:
            if not engine.config.enable_sleep_mode:
                raise ConfigError("idle_sleep", "needs sleep mode on (--enable-sleep-mode)")
            if isinstance(idle_sleep, bool) or not isinstance(idle_sleep, int | float) or not 0 < idle_sleep < 1e9:
                raise ConfigError("idle_sleep", f"must be a number of seconds in (0, 1e9), got {idle_sleep!r}")
        self.idle_sleep = idle_sleep
        self._clock = clock
        self._last_busy = clock()
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending_adds = 0  # enqueued, not yet drained; += on the loop, -= via call_soon_threadsafe
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        # Called on the event loop once the engine has failed for good (set by the server).
        self.on_dead: Callable[[BaseException], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests that will wait for a running slot: not-yet-drained adds count only beyond
        the slots free as of the last snapshot (the next step admits those at once)."""
        free_slots = max(0, self.engine.config.scheduler.max_num_seqs - self.snapshot.num_running)
        return max(0, self._pending_adds - free_slots) + self.snapshot.num_waiting

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop that will consume."""
        self._loop = asyncio.get_running_loop()
        self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is left, stop the thread. In-flight streams end with EngineDeadError."""
        self._stop.set()
        self._cmds.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        for s in list(self._streams.values()):
            s.put(EngineDeadError("the server is shutting down"))
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # the engine's thread no longer steps it

    # -- requests (event-loop thread) --------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    session_id: str | None = None, cache_salt: str | None = None) -> RequestStream:
        """Validate now (InvalidRequestError raises here, in the caller's thread), then enqueue."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error!r}")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        check_cache_salt(cache_salt)
        text, ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate(ids, params)
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._pending_adds += 1
        self._cmds.put(("add", request_id, {"prompt": text, "prompt_token_ids": ids, "cache_salt": cache_salt},
                        params, time.time(), session_id))
        return stream

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread (session pin / offload commands); the
        future holds what it returned or raised."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    def end_streams(self, make_error) -> None:
        """End every open stream with ``make_error()`` and abort its request (event-loop thread)."""
        for rid, s in list(self._streams.items()):
            s.put(make_error())
            self.abort(rid)

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(request_id, prompt, params):
            yield out

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished_requests()
            if block:  # checked on every pass: commands (an /is_sleeping poll) keep the drain busy
                self._sleep_if_idle()
                if self._capture_if_idle():  # more may follow: look at the queue without waiting
                    block = False
            drained = self._drain(block)
            if block:  # idle: every pass (commands such as a dashboard's polls may keep coming)
                self._idle_housekeeping(sessions=not drained)
            if not drained:
                continue
            if eng.has_unfinished_requests():  # commands alone (/is_sleeping polls) are not activity
                self._last_busy = self._clock()
            try:
                outputs = eng.step() if eng.has_unfinished_requests() else []
            except BaseException as e:  # noqa: BLE001 - any fault ends the engine; streams must hear
                log.exception("engine step failed; failing %d in-flight requests", len(self._streams))
                self.error = e
                self._loop.call_soon_threadsafe(self._fail_all, e)
                return
            self._take_snapshot()
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            for rid, err in eng.pop_failed().items():
                self._loop.call_soon_threadsafe(self._deliver_error, rid, err)
        for rid in list(eng.scheduler.groups):
            eng.abort_request(rid)
        self._take_snapshot()

    def _idle_housekeeping(self, sessions: bool) -> None:
        """Expired pins, the KV hand-over's landings and releases; with ``sessions`` (no command
        for a while) the sessions gone quiet long enough to leave the GPU."""
        eng = self.engine
        try:
            eng.housekeeping()
            if sessions:
                eng.offload_idle_sessions()
        except Exception:  # noqa: BLE001 - housekeeping must not kill the engine
            log.exception("idle housekeeping failed")

    def _sleep_if_idle(self) -> None:
        eng = self.engine
        if (self.idle_sleep is not None and not eng.is_sleeping() and not eng.has_unfinished_requests()
                and self._clock() - self._last_busy >= self.idle_sleep):
            log.info("no requests for %.0f s: sleeping (level 1)", self.idle_sleep)
            try:
                eng.sleep(1)
            except Exception:  # noqa: BLE001 - housekeeping must not kill the engine; retried next idle pass
                log.exception("idle sleep failed")
                self._last_busy = self._clock()
            self._take_snapshot()

    def _capture_if_idle(self) -> bool:
        """One CUDA graph per idle pass (``engine/graph_capture.py``): a request that arrives
        meanwhile waits for that one capture at most."""
        try:
            return self.engine.capture_idle_graph()
        except Exception:  # noqa: BLE001 - a failed size runs eagerly; the plan moves on
            log.exception("idle CUDA graph capture failed")
            return False

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; block briefly for the first one when idle. False: nothing to do.
        Only those queued when the drain began: one that a command's caller queues in reply (the
        next chunk of an embedding) waits for the step, so no caller holds the engine for longer
        than one command between two steps."""
        try:
            cmd = self._cmds.get(timeout=_IDLE_WAIT_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return not block
        drained, more = 0, self._cmds.qsize()
        while True:
            drained += self._apply(cmd)
            if more == 0:
                break
            try:
                cmd, more = self._cmds.get_nowait(), more - 1
            except queue.Empty:
                break
        self._take_snapshot()
        if drained:
            self._loop.call_soon_threadsafe(self._added, drained)
        return True

    def _apply(self, cmd: tuple) -> int:
        if cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
        elif cmd[0] == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller hears of it
                if isinstance(e, _CALLERS_ERRORS):  # a bad value or a refusal: the caller's 4xx
                    log.info("engine command refused: %s", e)
                else:
                    log.exception("engine command failed")
                fut.set_exception(e)
        elif cmd[0] == "add":
            _, rid, prompt, params, arrival, session_id = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival, session_id=session_id)
            except Exception as e:  # noqa: BLE001 - the request fails, the engine does not
                self._loop.call_soon_threadsafe(self._deliver_error, rid, e)
            return 1
        return 0

    def _take_snapshot(self) -> None:
        eng = self.engine
        pool, last = eng.kv.pool, eng.stats.last
        self.snapshot = EngineSnapshot(
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            kv_blocks_used=pool.num_used_blocks, kv_blocks_free=pool.num_free_blocks,
            kv_blocks_cached=pool.num_cached_blocks, kv_blocks_pinned=eng.pins.num_blocks,
            prefix_hit_rate=last.prefix_hit_rate if last else 0.0,
            num_preemptions=last.num_preemptions if last else 0,
            # The last step's waste while requests hold blocks; an idle engine wastes none.
            kv_waste=last.kv_waste if last and eng.has_unfinished_requests() else 0.0,
            prompt_tokens=eng.stats.prompt_tokens, generation_tokens=eng.stats.generation_tokens,
            prefix_cache_queries=eng.kv.prefix_queries, prefix_cache_hits=eng.kv.prefix_hits,
            spec_decode=eng.stats.spec.copy() if eng.stats.spec is not None else None)

    # -- callbacks run on the event loop -----------------------------------------------------
    def _added(self, n: int) -> None:
        self._pending_adds -= n

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is not None:
                s.put(out)

    def _deliver_error(self, request_id: str, e: BaseException) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            s.put(e)

    def _fail_all(self, cause: BaseException) -> None:
        err = EngineDeadError(f"engine step failed: {cause!r}")
        err.__cause__ = cause
        for s in list(self._streams.values()):
            s.put(err)
        if self.on_dead is not None:
            self.on_dead(cause)
