"""One-way message rings in host memory shared by two processes of one host: the control path
of ``CudaIpcConnector`` (kvserve/kvtier/ipc.py). The writer's engine thread puts a message, the
reader's engine thread takes it at its next poll; neither side blocks, wakes a thread or waits
for the interpreter lock another thread holds, which is what a hand-over of a few milliseconds
cannot afford.

    region   [write position u64 | pad][read position u64 | pad][ring of ``capacity`` bytes]
             (each position on its own 64-byte line; positions count bytes since the start and
             only grow, so a position modulo ``capacity`` is an offset in the ring)
    frame    [length u32][crc32 u32][payload][pad to 8 bytes], at an offset that is a multiple
             of 8; a length of ``SKIP`` says the next frame is at the ring's start

Invariants: one writer and one reader per ring. Each side keeps its own position in its own
memory and only stores it into the region (one aligned 8-byte store, which x86-64 and AArch64
make whole): the writer after a frame's bytes, the reader after it checked what it took. The
peer's position is read and checked (a multiple of 8, within one ring of one's own), never
trusted. The crc32 covers the frame's position, length and payload, so a frame read before all
of its bytes are visible (a CPU that reorders stores), or a stale frame of an earlier lap, is not
taken: the reader tries again at its next poll, and a frame still wrong after ``STALE_S``
seconds is a broken peer (``RingError``). The reader's store of its position depends on the
checked bytes, so it cannot become visible before the loads it follows.

The connector's messages are here too: a transfer (its id, the shared CUDA event behind its
blocks, their numbers in the producer's pool, their keys) on the data ring, its id alone on the
acknowledgements ring; ``decode_transfer`` checks every field a peer could get wrong.
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
_POS = struct.Struct("<QI")
MAX_ID, MAX_KEY = 64, 32  # bytes of a transfer id, of a block key (the prefix cache's: 16)
EVENT_SLOTS = 64  # shared CUDA events: transfers whose readiness the consumer's device awaits
_HEAD = struct.Struct("<HhII")  # id bytes, event slot (-1: none), blocks, bytes per key
_MAX_MESSAGE = 16 << 20  # (about 800k blocks a transfer, with the prefix cache's keys)
_ACK_RING = 64 << 10


class RingError(RuntimeError):
    """The other side wrote what no writer of this protocol writes."""


def ring_bytes(capacity: int) -> int:
    """Bytes of shared memory a ring of ``capacity`` bytes takes (a multiple of 64)."""
    return HEADER + (capacity + 63) // 64 * 64


def _crc(pos: int, n: int, payload: bytes = b"") -> int:
    return zlib.crc32(payload, zlib.crc32(_POS.pack(pos, n)))


class Ring:
    """A ring over ``mem`` (a uint8 numpy array of ``ring_bytes(capacity)`` bytes in shared
    memory, zero when new). ``max_payload``: the largest message either side accepts."""

    def __init__(self, mem: np.ndarray, capacity: int, max_payload: int):
        if capacity % 8 or capacity < 64 or mem.nbytes != ring_bytes(capacity) or max_payload + 16 > capacity // 2:
            raise ValueError(f"a ring of {capacity} bytes in {mem.nbytes} cannot carry {max_payload}-byte messages")
        self.capacity, self.max_payload = capacity, max_payload
        self._wpos = mem[0:8].view(np.uint64)
        self._rpos = mem[64:72].view(np.uint64)
        self._ring = mem[HEADER:HEADER + capacity]
        self._w, self._r = int(self._wpos[0]), int(self._rpos[0])  # (each side uses its own)
        self._stale_since: float | None = None

    def put(self, payload: bytes) -> bool:
        """Append one message; False: the reader has not made room for it yet (try later)."""
        n, w, cap = len(payload), self._w, self.capacity
        if n > self.max_payload:
            raise ValueError(f"a {n}-byte message is over this ring's {self.max_payload}")
        r = int(self._rpos[0])
        if r % 8 or not w - cap <= r <= w:
            raise RingError(f"read position {r} against write position {w} in a {cap}-byte ring")
        size = (8 + n + 7) & ~7
        off = w % cap
        waste = cap - off if off + size > cap else 0
        if w + waste + size - r > cap:
            return False
        if waste:
            self._ring[off:off + 8] = np.frombuffer(_FRAME.pack(SKIP, _crc(w, SKIP)), np.uint8)
            w += waste
            off = 0
        self._ring[off + 8:off + 8 + n] = np.frombuffer(payload, np.uint8)
        self._ring[off:off + 8] = np.frombuffer(_FRAME.pack(n, _crc(w, n, payload)), np.uint8)
        self._w = w + size
        self._wpos[0] = self._w  # (last: the reader takes nothing before this store)
        return True

    def take(self) -> list[bytes]:
        """Every whole message written since the last call, oldest first."""
        r, cap, out = self._r, self.capacity, []
        w = int(self._wpos[0])
        if w % 8 or not r <= w <= r + cap:
            raise RingError(f"write position {w} against read position {r} in a {cap}-byte ring")
        while r < w:
            off = r % cap
            n, crc = _FRAME.unpack(self._ring[off:off + 8].tobytes())
            if n == SKIP:
                ok = off > 0 and r + cap - off <= w and crc == _crc(r, SKIP)
                step, payload = cap - off, None
            else:
                step = (8 + n + 7) & ~7
                ok = n <= self.max_payload and off + step <= cap and r + step <= w
                payload = self._ring[off + 8:off + 8 + n].tobytes() if ok else None
                ok = ok and crc == _crc(r, n, payload)
            if not ok:  # (not all visible yet, or written wrong)
                now = time.monotonic()
                self._stale_since = self._stale_since or now
                if now - self._stale_since > STALE_S:
                    raise RingError(f"the frame at {r} (written up to {w}) is not one this protocol writes")
                break
            self._stale_since = None
            if payload is not None:
                out.append(payload)
            r += step
        self._r = r
        self._rpos[0] = r
        return out


# -- CudaIpcConnector's messages ----------------------------------------------------------
def encode_transfer(tid: str, keys: list[bytes], blocks: list[int], slot: int = -1) -> bytes:
    """One data-ring message: the transfer's id, its event slot, its block numbers in the
    producer's pool and their keys (all of one length)."""
    t = tid.encode()
    width = len(keys[0]) if keys else 0
    if len(t) > MAX_ID or width > MAX_KEY or any(len(k) != width for k in keys) or len(keys) != len(blocks):
        raise ValueError(f"transfer {tid[:40]!r}: {len(keys)} keys for {len(blocks)} blocks, "
                         f"ids up to {MAX_ID} bytes, keys of one length up to {MAX_KEY}")
    return _HEAD.pack(len(t), slot, len(blocks), width) + t + np.asarray(blocks, dtype="<i4").tobytes() + b"".join(keys)


def decode_transfer(msg: bytes, pool_blocks: int, slots: int) -> tuple[str, int, list[int], list[bytes]]:
    """(id, event slot, blocks, keys) of a data-ring message; RingError where it is not one
    this producer's pool and events allow."""
    if len(msg) < _HEAD.size:
        raise RingError(f"a transfer message of {len(msg)} bytes")
    nt, slot, n, width = _HEAD.unpack_from(msg)
    body = _HEAD.size + nt
    if (nt > MAX_ID or not 0 < width <= MAX_KEY or not -1 <= slot < slots
            or len(msg) != body + n * (4 + width)):
        raise RingError(f"a transfer message of {len(msg)} bytes: id {nt}, slot {slot}, {n} blocks of "
                        f"{width}-byte keys")
    try:  # (strict: an acknowledgement must name the id with the very bytes it came with)
        tid = msg[_HEAD.size:body].decode()
    except UnicodeDecodeError:
        raise RingError("a transfer id that is not UTF-8") from None
    ids = np.frombuffer(msg, dtype="<i4", count=n, offset=body)
    if n and (ids.min() < 0 or ids.max() >= pool_blocks):
        raise RingError(f"transfer {tid!r:.40}: a block outside the producer's pool of {pool_blocks}")
    keys = msg[body + 4 * n:]
    return tid, slot, ids.tolist(), [keys[j:j + width] for j in range(0, n * width, width)]


def rings(max_blocks: int) -> tuple[int, int, int]:
    """(data ring bytes, largest message, acknowledgements ring bytes) for a producer holding
    ``max_blocks`` at most: the data ring takes three of the largest messages wherever its write
    position stands (a producer holds one such transfer at a time)."""
    largest = min(_HEAD.size + MAX_ID + max_blocks * (4 + MAX_KEY), _MAX_MESSAGE)
    return 4 * ((largest + 23) & ~7), largest, _ACK_RING
