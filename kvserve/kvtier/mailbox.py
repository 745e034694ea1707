"""One-way message rings in host memory shared by two processes of one host: the control path
of ``CudaIpcConnector`` (kvserve/kvtier/ipc.py). The writer's engine thread puts a message, the
reader's engine thread takes it at its next poll; neither side blocks, wakes a thread or waits
for the interpreter lock another thread holds, which is what a hand-over of a few milliseconds
cannot afford.

    region   [write position u64 | pad][read position u64 | pad][ring of ``capacity`` bytes]
             (each position on its own 64-byte line; positions count bytes since the start and
             only grow, so a position modulo ``capacity`` is an offset in the ring)
    frame    [length u32][crc32 u32][payload][pad to 8 bytes], at an offset that is a
             multiple of 8; a length of ``SKIP`` says the frame went to the ring's start

Invariants: one writer and one reader per ring. The writer stores a frame's bytes, then its
write position (one aligned 8-byte store); the reader stores its read position once it has
copied what it took. The crc32 covers the frame's position and payload, so a frame read before
all of its bytes are visible (a CPU that reorders stores) is not taken: the reader tries again
at its next poll, and a frame still wrong after ``STALE_S`` seconds is a broken peer.
"""
from __future__ import annotations

import struct
import time
import zlib

import numpy as np

HEADER = 128  # the two positions, each on its own cache line
SKIP = 0xFFFFFFFF
STALE_S = 1.0
_FRAME = struct.Struct("<II")


class RingError(RuntimeError):
    """The other side wrote what no writer of this protocol writes."""


def ring_bytes(capacity: int) -> int:
    """Bytes of shared memory a ring of ``capacity`` bytes takes."""
    return HEADER + capacity


class Ring:
    """A ring over ``mem`` (a uint8 numpy array of ``ring_bytes(capacity)`` bytes in shared
    memory, zero when new). ``max_payload``: the largest message either side accepts."""

    def __init__(self, mem: np.ndarray, capacity: int, max_payload: int):
        if capacity % 8 or capacity < 64 or mem.nbytes != ring_bytes(capacity) or max_payload + 16 > capacity // 2:
            raise ValueError(f"a ring of {capacity} bytes in {mem.nbytes} cannot carry {max_payload}-byte messages")
        self.capacity, self.max_payload = capacity, max_payload
        self._wpos = mem[0:8].view(np.uint64)
        self._rpos = mem[64:72].view(np.uint64)
        self._ring = mem[HEADER:]
        self._stale_since: float | None = None

    def put(self, payload: bytes) -> bool:
        """Append one message; False: the reader has not made room for it yet (try later)."""
        n = len(payload)
        if n > self.max_payload:
            raise ValueError(f"a {n}-byte message is over this ring's {self.max_payload}")
        w, cap = int(self._wpos[0]), self.capacity
        size = (8 + n + 7) & ~7
        off = w % cap
        waste = cap - off if off + size > cap else 0
        if w + waste + size - int(self._rpos[0]) > cap:
            return False
        if waste:
            self._ring[off:off + 4] = np.frombuffer(struct.pack("<I", SKIP), np.uint8)
            w += waste
            off = 0
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<Q", w)))
        self._ring[off + 8:off + 8 + n] = np.frombuffer(payload, np.uint8)
        self._ring[off:off + 8] = np.frombuffer(_FRAME.pack(n, crc), np.uint8)
        self._wpos[0] = w + size  # (last: the reader takes nothing before this store)
        return True

    def take(self) -> list[bytes]:
        """Every whole message written since the last call, oldest first."""
        r, w, cap, out = int(self._rpos[0]), int(self._wpos[0]), self.capacity, []
        if w - r > cap or w % 8:
            raise RingError(f"write position {w} against read position {r} in a {cap}-byte ring")
        while r < w:
            off = r % cap
            n, crc = _FRAME.unpack(self._ring[off:off + 8].tobytes())
            if n == SKIP:
                r += cap - off
                continue
            size = (8 + n + 7) & ~7
            if n > self.max_payload or off + size > cap or r + size > w:
                raise RingError(f"a frame of {n} bytes at {r} (written up to {w})")
            payload = self._ring[off + 8:off + 8 + n].tobytes()
            if zlib.crc32(payload, zlib.crc32(struct.pack("<Q", r))) != crc:
                now = time.monotonic()  # (not visible yet, or written wrong)
                self._stale_since = self._stale_since or now
                if now - self._stale_since > STALE_S:
                    raise RingError(f"the frame at {r} fails its checksum")
                break
            self._stale_since = None
            out.append(payload)
            r += size
        self._rpos[0] = r
        return out
