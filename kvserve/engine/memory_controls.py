"""The engine's memory controls beside its step loop: the KV tiers and the store behind them,
idle sessions moved out, prefixes pinned in the prefix cache, and sleep and wake."""
from __future__ import annotations

import logging
import os

from kvserve.engine.sleep_mode import PARTS
from kvserve.errors import ConfigError, EngineBusyError, InvalidRequestError, WakeUpError

log = logging.getLogger("kvserve.engine.llm_engine")


def check_cache_salt(cache_salt) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt", f"must be a non-empty string, got {cache_salt!r}")


class MemoryControls:
    """LLMEngine's tiers, sessions, pins and sleep (the engine holds the config, scheduler, KV
    manager, runner, store and pins)."""

    @staticmethod
    def _connector(store):
        from kvserve.kvtier.connector import TierConnector
        return TierConnector(store)

    def _allocate_kv(self, plan) -> None:
        """The runner's KV pool: a CudaIpcConnector producer's in memory its consumer maps."""
        kt, self.kv_shared = self.config.kv_transfer_config, None
        if kt is not None and kt.kv_connector == "CudaIpcConnector" and kt.is_producer:
            from kvserve.kvtier.ipc import shared_zeros

            def alloc(shape, dtype, device):
                if self.kv_shared is not None:  # (sleep mode, which re-allocates it, is refused)
                    raise RuntimeError("the shared KV pool of a CudaIpcConnector producer is allocated once")
                t, self.kv_shared = shared_zeros(shape, dtype, device)
                return t
            self.runner.kv_alloc = alloc
        self.runner.allocate_kv_cache(plan)

    def housekeeping(self) -> None:
        """Before each step, and between steps when idle: expired pins go, the KV hand-over
        lands what arrived and releases what the consumer copied."""
        if self.pins.pins:
            self.pins.expire()
        if self.kv_transfer is not None:
            self.kv_transfer.poll()

    def _transfer_held(self) -> list[int]:
        return self.kv_transfer.held() if self.kv_transfer is not None else []

    def _kv_transfer(self):
        from kvserve.engine.kv_transfer import KVTransfer
        kt = KVTransfer(self)
        if kt.consumer is not None:
            self.tiers.remote = kt.consumer
        return kt

    def _make_store(self, cache, kv_transfer=None):
        from kvserve.errors import ConfigError
        from kvserve.kvtier import TieredStore
        if not cache.enable_prefix_caching:
            raise ConfigError("cpu_kv_memory/disk_kv_dir/redis_url", "the KV tiers are keyed by the prefix "
                              "cache's block hashes: they need prefix caching on")
        rt = self.runner
        shape, dtype = rt.kv_cache.block_shape, rt.kv_cache.data.dtype
        if cache.disk_kv_dir is not None:
            try:
                os.makedirs(cache.disk_kv_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError("disk_kv_dir", f"cannot create {cache.disk_kv_dir!r}: {e.strerror}") from None
        if cache.redis_url is not None:
            try:
                import redis  # noqa: F401
            except ImportError:
                raise ConfigError("redis_url", "needs the 'redis' package (pip install redis)") from None
        secret = None
        if cache.disk_kv_dir is not None or cache.redis_url is not None:
            from kvserve.kvtier.secret import tier_secret
            secret = tier_secret(cache.kv_tier_secret, cache.disk_kv_dir)
        return TieredStore(shape, dtype, rt.device, cpu_bytes=cache.cpu_kv_memory, disk_dir=cache.disk_kv_dir,
                           disk_bytes=cache.disk_kv_size, redis_url=cache.redis_url, block_size=cache.block_size,
                           secret=secret, encrypt=cache.kv_tier_encrypt,
                           staging_bytes=int(kv_transfer.kv_buffer_size) if kv_transfer is not None else 0)

    def offload_idle_sessions(self, force: bool = False, only: str | None = None) -> int:
        """Move the KV of sessions idle for ``idle_offload_seconds`` (all, with ``force``) from
        the GPU prefix cache to the tiers; their blocks become plain free blocks. Returns blocks
        moved. A pinned session stays."""
        if self.store is None:
            return 0
        pool = self.kv.pool
        moves = [(bid, key) for key in self.sessions.take_idle(force, only)
                 if (bid := pool.lookup(key)) is not None and pool.blocks[bid].ref_cnt == 0]
        if moves:
            # Most are in the tiers already (written at the end of their turn): only the rest
            # is copied, straight into the CPU tier's pinned slots.
            self.tiers.offload(self.runner.kv_cache.data, moves)
            for bid, _ in moves:
                pool.uncache(bid)
            self.store.load_stats.idle_offloaded_blocks += len(moves)
        return len(moves)

    def _end_session_turn(self, session_id: str, keys: list[bytes]) -> None:
        """A session's turn finished: remember its blocks, and copy those the tiers do not hold
        yet into them now, while their KV is certainly on the GPU. When the GPU cache later
        evicts them, or the session goes idle, they leave without a copy on the step's path."""
        self.sessions.end_turn(session_id, keys)
        if self.store is None or session_id in self.sessions.pinned:
            return
        blocks = [(bid, k) for k in keys if (bid := self.kv.pool.lookup(k)) is not None]
        n = self.tiers.offload(self.runner.kv_cache.data, blocks)
        self.store.load_stats.session_blocks_written += n

    def _tier_copy_seconds(self) -> float:
        st = self.store.load_stats if self.store is not None else None
        return st.load_seconds + st.offload_seconds if st is not None else 0.0

    def pin_session(self, session_id: str, pinned: bool = True) -> None:
        self.sessions.pin(session_id, pinned)

    def pin_prefix(self, prompt: str | list[int] | dict, owner: str, cache_salt: str | None = None) -> int:
        """Keep the cached blocks of ``prompt``'s full blocks (as far as they are cached) out of
        the LRU's reach for ``owner`` until ``unpin(owner)``, the TTL, or the pin budget releases
        them (engine/prefix_pins.py). Returns the number of tokens pinned."""
        check_cache_salt(cache_salt)
        if not isinstance(owner, str) or not owner:
            raise InvalidRequestError("owner", f"must be a non-empty string, got {owner!r:.50}")
        return self.pins.pin(self.tokenize_prompt(prompt)[1], cache_salt, owner)

    def unpin(self, owner: str) -> int:
        """Release ``owner``'s hold on every pinned prefix. Returns pins released."""
        return self.pins.unpin(owner)

    def flush_kv_to_tiers(self) -> int:
        """Write every block of the GPU prefix cache to the tiers and wait for the writes (at
        shutdown, so a restart or another replica finds them). Returns blocks written."""
        if self.store is None:
            return 0
        moves = [(bid, h) for h, bid in list(self.kv.pool.cached.items())]
        if self.runner.kv_cache is not None:  # asleep: the prefix cache went to the tiers at sleep
            self.tiers.offload(self.runner.kv_cache.data, moves, wait=True)
        self.store.flush()
        return len(moves)

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back: level 1 keeps the weights in host memory, level 2 drops
        them (waking reloads them from the model's source). The KV pool is discarded either
        way, after the KV tiers (if on) have taken the prefix cache. Refused while requests
        are in flight (they are not waited for: the caller decides when the engine is idle).
        Asleep already: nothing changes, at whichever level it sleeps."""
        mode = self._sleep_mode()
        if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
            raise InvalidRequestError("level", f"must be 1 or 2, got {level!r:.50}")
        if mode.asleep:
            return
        if self.has_unfinished_requests():
            raise EngineBusyError(f"cannot sleep with {self.scheduler.num_unfinished} requests in flight; "
                                  "sleep once they have finished (or abort them)")
        self.flush_kv_to_tiers()
        self.pins.clear()
        self.kv.pool.reset_prefix_cache()  # the blocks' KV is about to be gone
        mode.sleep(level)

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        """Bring back ``tags`` of ("weights", "kv_cache"), None: both. Awake already: nothing
        happens. A failure raises WakeUpError and leaves that part asleep, to retry."""
        mode = self._sleep_mode()
        if tags is None:
            tags = PARTS
        if not isinstance(tags, (list, tuple)) or not tags or any(t not in PARTS for t in tags):
            raise InvalidRequestError("tags", f"must be a non-empty list of {', '.join(PARTS)}, got {tags!r:.100}")
        try:
            mode.wake_up(tuple(tags))
        except Exception as e:  # noqa: BLE001 - any cause: the engine stays asleep, a retry may work
            log.exception("waking up failed")
            raise WakeUpError(f"waking up failed ({type(e).__name__}: {e}); the engine sleeps on "
                              f"({', '.join(sorted(mode.asleep))} asleep); retry wake_up") from e

    def is_sleeping(self) -> bool:
        mode = self.runner.sleep_mode
        return mode is not None and bool(mode.asleep)

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level of the current sleep."""
        mode = self.runner.sleep_mode
        return 0 if mode is None else mode.level

    def _sleep_mode(self):
        if self.runner.sleep_mode is None:
            raise ConfigError("enable_sleep_mode", "sleep mode is off; start the engine with "
                              "LLM(..., enable_sleep_mode=True) or kvserve serve --enable-sleep-mode")
        return self.runner.sleep_mode

    def _wake_for_work(self) -> None:
        """A request or embedding that arrives while the engine sleeps wakes it and is served."""
        if self.is_sleeping():
            self.wake_up()
