"""The tiers below memory: a disk directory and Redis.

Both hold encoded chunks (``chunk.py``) and fail soft: an I/O error turns the tier's writes off
(disk full, read-only directory: tried again every ``RETRY_S`` seconds, so a disk that has room
again is written again) or the whole tier off until it answers again (Redis), logged once, and the
engine keeps serving from the other tiers or by recomputing.
"""
from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvserve.kvtier.tiers import TierStats

log = logging.getLogger(__name__)


class DiskTier:
    """One file per chunk under ``root`` (``ab/abcdef….kvc``), written to a temporary file and
    renamed into place (a reader never sees half a chunk), bounded by ``capacity`` bytes with LRU
    eviction. Survives restarts: the index is rebuilt from the directory at start."""

    name = "disk"
    RETRY_S = 30.0  # writes off after a write error: one write is tried again this often

    def __init__(self, root: str, capacity: int, clock: Callable[[], float] = time.monotonic):
        self.root = os.path.abspath(root)
        self.capacity = capacity
        self.clock = clock
        self._retry_at = 0.0
        self.stats = TierStats()
        self.lock = threading.Lock()
        os.makedirs(self.root, exist_ok=True)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # key -> size, LRU order
        entries = []
        for sub in os.listdir(self.root):
            d = os.path.join(self.root, sub)
            if len(sub) != 2 or not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if not name.endswith(".kvc"):
                    continue
                try:
                    key = bytes.fromhex(name[:-4])
                    st = os.stat(os.path.join(d, name))
                except (ValueError, OSError):
                    continue
                entries.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(entries):
            self.files[key] = size
        self.used = sum(self.files.values())
        self._evict_to(self.capacity)  # restarted with a smaller quota
        if not os.access(self.root, os.W_OK):
            self._stop_writes(f"directory {self.root} is not writable")

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + ".kvc")

    def __contains__(self, key: bytes) -> bool:
        return key in self.files

    def holds(self, key: bytes) -> bool:
        return key in self.files

    def adopt(self, key: bytes) -> bool:
        """Whether ``key``'s chunk is here, taking into the index one that another process
        wrote since the index was built (a disaggregated prefill instance sharing the directory)."""
        if key in self.files:
            return True
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            return False
        with self.lock:
            if key not in self.files:
                self.files[key] = size
                self.used += size
        return True

    def _stop_writes(self, why: str) -> None:
        if self.stats.writable:
            log.warning("disk KV tier: writes off (%s); reads continue, writes tried again every %.0f s",
                        why, self.RETRY_S)
        self.stats.writable = False
        self.stats.last_error = why
        self._retry_at = self.clock() + self.RETRY_S

    def put(self, key: bytes, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        retrying = not self.stats.writable
        if retrying and self.clock() < self._retry_at:
            return False
        with self.lock:
            if key in self.files:
                self.files.move_to_end(key)
                return True
            self._evict_to(self.capacity - len(data))
        t0 = time.perf_counter()
        path = self.path(key)
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self.stats.errors += 1
            if e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT):
                self._stop_writes(f"{os.strerror(e.errno)} writing {path}")
            else:
                self.stats.last_error = str(e)
            return False
        if retrying:
            log.warning("disk KV tier: writes back on")
            self.stats.writable = True
        with self.lock:
            self.files[key] = len(data)
            self.used += len(data)
            self.stats.stores += 1
            self.stats.bytes_in += len(data)
            self.stats.store_seconds += time.perf_counter() - t0
        return True

    def get(self, key: bytes) -> bytes | None:
        if key not in self.files:
            self.stats.misses += 1
            return None
        t0 = time.perf_counter()
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
        except OSError:
            self.drop(key)
            self.stats.misses += 1
            return None
        with self.lock:
            if key in self.files:
                self.files.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_out += len(data)
        self.stats.load_seconds += time.perf_counter() - t0
        return data

    def _evict_to(self, limit: int) -> None:
        """Delete the least recently used chunks until ``used <= limit`` (caller holds the lock)."""
        while self.used > limit and self.files:
            old, size = self.files.popitem(last=False)
            self.used -= size
            self._unlink(old)

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def drop(self, key: bytes) -> None:
        """Forget a chunk (it failed its checks, or vanished)."""
        with self.lock:
            size = self.files.pop(key, None)
            if size is not None:
                self.used -= size
        self._unlink(key)


class RedisTier:
    """Chunks as Redis strings under ``kvserve:kv:<key hex>``, shared by every process that points
    at the same server. When Redis does not answer, the tier is off (logged once, ``available``
    false in stats) and is tried again every ``retry_seconds`` of ``clock`` (monotonic seconds;
    tests replace it instead of sleeping).

    ``known`` lists (LRU, bounded) the keys this process wrote to or read from the server, so a
    block whose chunk Redis already holds is not sent again each time it leaves the GPU. Redis may
    still drop one (maxmemory, TTL): a later read misses, forgets it, and the block is recomputed
    and written again."""

    name = "redis"
    PREFIX = b"kvserve:kv:"
    KNOWN_MAX = 1 << 18

    def __init__(self, url: str, retry_seconds: float = 2.0, timeout: float = 1.0, ttl_seconds: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        import redis
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.errors_cls = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.retry_seconds = retry_seconds
        self.ttl = ttl_seconds
        self.clock = clock
        self.stats = TierStats()
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self._known_lock = threading.Lock()
        self._next_try = 0.0
        try:
            self.client.ping()
        except self.errors_cls as e:
            self._down(e)

    def _down(self, e: BaseException) -> None:
        with self._known_lock:  # it may come back empty (restarted, failed over)
            self.known.clear()
        self.stats.errors += 1
        self.stats.last_error = repr(e)
        if self.stats.available:
            log.warning("Redis KV tier at %s unreachable (%s): off until it answers again", self.url, e)
        self.stats.available = False
        self._next_try = self.clock() + self.retry_seconds

    def may_answer(self) -> bool:
        """Up, or down with a retry due: only asking tells whether it holds a chunk."""
        return self.stats.available or self.clock() >= self._next_try

    def _usable(self) -> bool:
        if self.stats.available:
            return True
        if self.clock() < self._next_try:
            return False
        try:
            self.client.ping()
        except self.errors_cls as e:
            self._down(e)
            return False
        log.warning("Redis KV tier at %s is back", self.url)
        self.stats.available = True
        return True

    def _key(self, key: bytes) -> bytes:
        return self.PREFIX + key.hex().encode()

    def holds(self, key: bytes) -> bool:
        """Whether this process saw the server hold ``key`` (no round trip)."""
        with self._known_lock:
            return key in self.known

    def _saw(self, key: bytes, held: bool) -> None:
        with self._known_lock:
            if not held:
                self.known.pop(key, None)
                return
            self.known[key] = None
            self.known.move_to_end(key)
            if len(self.known) > self.KNOWN_MAX:
                self.known.popitem(last=False)

    def contains(self, key: bytes) -> bool:
        if not self._usable():
            return False
        try:
            return bool(self.client.exists(self._key(key)))
        except self.errors_cls as e:
            self._down(e)
            return False

    def put(self, key: bytes, data: bytes) -> bool:
        if not self._usable():
            return False
        t0 = time.perf_counter()
        try:
            self.client.set(self._key(key), data, ex=self.ttl)
        except self.errors_cls as e:
            self._down(e)
            return False
        self._saw(key, True)
        self.stats.stores += 1
        self.stats.bytes_in += len(data)
        self.stats.store_seconds += time.perf_counter() - t0
        return True

    def get(self, key: bytes) -> bytes | None:
        if not self._usable():
            self.stats.misses += 1
            return None
        t0 = time.perf_counter()
        try:
            data = self.client.get(self._key(key))
        except self.errors_cls as e:
            self._down(e)
            self.stats.misses += 1
            return None
        self._saw(key, data is not None)
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_out += len(data)
        self.stats.load_seconds += time.perf_counter() - t0
        return data

    def drop(self, key: bytes) -> None:
        self._saw(key, False)
        try:
            if self._usable():
                self.client.delete(self._key(key))
        except self.errors_cls as e:
            self._down(e)
