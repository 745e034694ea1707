"""``CudaIpcConnector``: disaggregated prefill and decode between two processes of one host. The
consumer maps the producer's whole KV pool and copies a prompt's blocks straight out of it into
its own: one device-to-device copy per byte, no buffer in between, no trip through host memory.

    connect   the gloo channel of kvserve/kvtier/transfer.py checks the layouts; the producer's
              pool was allocated shareable (``SharedBuffer``: device memory with CUDA IPC, or a
              host file); it sends the pool's handle and shape, the handle of two message rings
              in host memory (kvserve/kvtier/mailbox.py) and, on a GPU, of a set of CUDA events
              both processes share; the consumer maps them and answers whether it could. After
              that the channel carries one message at most, the consumer's word that it ended
              the transfer (a peer that broke the protocol) once its copies completed; a thread
              on each side waits on it for that, or to learn that the peer's process is gone.
    producer  engine thread, a request finished: its prompt's blocks are *held* (one more
              reference each in the producer's pool, so they are neither reused nor evicted),
              at most ``kv_buffer_size`` bytes at a time; a shared event is recorded behind the
              step that wrote them and {id, event, blocks, keys} goes into the data ring at once.
              Each ``take_released`` (the engine's housekeeping) reads the acknowledgements ring
              and releases the blocks of every acknowledged transfer.
    consumer  engine thread (``land``, at each step and when idle, not while asleep): takes what
              the data ring holds; for the keys not cached here it allocates blocks, has the
              device wait for the producer's event, copies producer -> consumer (the block-copy
              kernel on a GPU), registers them in the prefix cache under their keys (free and
              cached: the request's prefix lookup revives them), and puts the id of each transfer
              whose copy completed into the acknowledgements ring.

No thread sits on the hand-over's path: a message is a few stores into shared memory, read by
the other engine thread between its steps, so neither the interpreter lock nor a thread's
wake-up stands between the producer's step and the consumer's copy.

Invariants: a held block is referenced by the producer's pool until its acknowledgement, the
consumer's word that it ended, or the end of the consumer's process releases it, so the consumer
never reads a block the producer reuses (a consumer that breaks the protocol but may still be
copying leaves its blocks held for good); the consumer acknowledges only after its copy
finished, and a transfer's event slot is recorded again only after its acknowledgement (the
consumer's wait on it has passed). Landing takes free blocks of the consumer's pool and gives
them back as cached ones, so it never takes room from a running request, and it holds the
transfer's blocks that were cached here already while it allocates; when the pool has fewer free
blocks than a transfer, the first ones land (keys are chained: a prefix of them is still a prefix
hit) and the rest is computed.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

import numpy as np
import torch

from kvserve.errors import ConfigError
from kvserve.kvtier.ipc_buffer import SharedBuffer
from kvserve.kvtier.mailbox import (
    EVENT_SLOTS,
    MAX_ID,
    Ring,
    RingError,
    decode_transfer,
    encode_transfer,
    ring_bytes,
    rings,
)
from kvserve.kvtier.transfer import Channel, Consumer, ProtocolError

log = logging.getLogger(__name__)

DATA, ACK = 0, 1  # channel tags: producer -> consumer, consumer -> producer (after connect: its end)


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, SharedBuffer]:
    """A zero-filled tensor in memory another process of this host can map, and its buffer."""
    buf = SharedBuffer.create(device, math.prod(shape) * dtype.itemsize)
    if buf.tensor.is_cuda:  # (a new host file reads as zeros)
        buf.tensor.zero_()
    return buf.tensor.view(dtype).view(shape), buf


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, sources: list[int], dests: list[int]) -> None:
    """``dst[:, :, d] = src[:, :, s]`` for each pair, one read and one write per byte."""
    from kvserve import kernels
    if kernels.available(dst):
        from kvserve.kernels.block_copy import copy_blocks as kernel
        ids = torch.from_numpy(np.array((sources, dests), dtype=np.int64))
        kernel(src, dst, ids.to(dst.device, non_blocking=True))
        return
    i = 0
    while i < len(sources):  # runs of consecutive blocks on both sides, one strided copy each
        j = i + 1
        while j < len(sources) and sources[j] == sources[j - 1] + 1 and dests[j] == dests[j - 1] + 1:
            j += 1
        s, d, n = sources[i], dests[i], j - i
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])
        i = j


def _ring_views(buf: SharedBuffer, data_bytes: int, largest: int, ack_bytes: int) -> tuple[Ring, Ring]:
    mem = buf.tensor.numpy()
    a = ring_bytes(data_bytes)
    return Ring(mem[:a], data_bytes, largest), Ring(mem[a:a + ring_bytes(ack_bytes)], ack_bytes, MAX_ID)


class IpcProducer:
    """The producer's half: holds blocks for the consumer and releases them when told."""

    def __init__(self, channel: Channel, pool: SharedBuffer, shape: tuple[int, ...], dtype: torch.dtype,
                 block_bytes: int, buffer_bytes: float):
        self.channel, self.block_bytes, self.device = channel, block_bytes, pool.tensor.device
        self.max_blocks = int(buffer_bytes) // block_bytes
        mailbox = None
        try:
            if self.max_blocks < 1:
                raise ConfigError("kv_transfer_config.kv_buffer_size", f"{int(buffer_bytes)} bytes cannot hold one "
                                  f"KV block ({block_bytes} bytes) for the consumer")
            sizes = rings(min(self.max_blocks, shape[2]))
            mailbox = SharedBuffer.create(torch.device("cpu"), ring_bytes(sizes[0]) + ring_bytes(sizes[2]),
                                          "kv_transfer_config.kv_buffer_size",
                                          "the rings that carry the producer's transfers and their acknowledgements")
            self.data, self.acks = _ring_views(mailbox, *sizes)
            self.events: list = []
            if self.device.type == "cuda":  # (recorded once: CUDA creates an event at its first record)
                with torch.cuda.device(self.device):
                    self.events = [torch.cuda.Event(interprocess=True) for _ in range(EVENT_SLOTS)]
                    for e in self.events:
                        e.record()
            channel.send_message({"pool": pool.handle, "shape": list(shape), "dtype": str(dtype),
                                  "mailbox": mailbox.handle, "rings": list(sizes),
                                  "events": [e.ipc_handle().hex() for e in self.events]})
            reply, _ = channel.recv_message(0)
        except ConfigError:
            channel.send_message({"pool": None})  # (the consumer must not wait for it)
            channel.close()
            raise
        except Exception as e:
            channel.close()
            raise ConfigError("kv_transfer_config", f"the consumer left while connecting: {e}"[:500]) from None
        finally:
            pool.unlink()
            if mailbox is not None:
                mailbox.unlink()
        if not reply.get("attached"):
            channel.close()
            raise ConfigError("kv_transfer_config", f"the consumer could not map this producer's KV pool "
                              f"(CudaIpcConnector links two processes of one host): {reply.get('error')}"[:500])
        self.mailbox = mailbox
        self.held: dict[str, tuple[list[int], int]] = {}  # transfer id -> (its blocks, its event slot)
        self.released: list[list[int]] = []
        self.free_slots = list(range(len(self.events)))[::-1]
        self.sent_blocks = self.dropped = 0
        self.dead = False
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="kv-transfer-watch").start()

    @property
    def held_blocks(self) -> list[int]:
        """Every block this side still references: held, or released and not yet taken."""
        with self._lock:
            return [b for ids in (*(h[0] for h in self.held.values()), *self.released) for b in ids]

    def send(self, tid: str, keys: list[bytes], blocks: list[int]) -> bool:
        """Offer ``blocks`` (the caller took a reference on each) under ``keys``; False: not sent
        (the connection ended; more would be held than ``kv_buffer_size``; the data ring has no
        room until the consumer's next landing; no blocks, an id held already, or a message over
        the ring's largest), the caller drops its references again."""
        with self._lock:
            if (self.dead or not blocks or tid in self.held
                    or sum(len(h[0]) for h in self.held.values()) + len(blocks) > self.max_blocks):
                self.dropped += 1
                return False
        slot = -1
        if self.device.type == "cuda":  # the consumer's device waits for the step that wrote them
            if self.free_slots:
                slot = self.free_slots.pop()
                self.events[slot].record(torch.cuda.current_stream(self.device))
            else:  # (every shared event awaits an acknowledgement: wait here instead)
                torch.cuda.current_stream(self.device).synchronize()
        try:
            msg = encode_transfer(tid, keys, blocks, slot)
            if len(msg) > self.data.max_payload:
                raise ValueError(f"{len(blocks)} blocks are more than one message carries")
        except ValueError as e:
            log.warning("KV transfer %s not sent, its consumer computes its prompt: %s", tid[:40], e)
            msg = None
        with self._lock:
            try:
                sent = msg is not None and not self.dead and self.data.put(msg)
            except RingError as e:
                sent = False
                self._end(f"KV transfer to the consumer ended ({e}); prompts are no longer sent, and the blocks "
                          f"it may still read stay held", release=False, locked=True)
            if not sent:
                self.dropped += 1
                if slot >= 0:
                    self.free_slots.append(slot)
                return False
            self.held[tid] = (blocks, slot)
        self.sent_blocks += len(blocks)
        return True

    def take_released(self) -> list[list[int]]:
        """Blocks whose transfers ended (engine thread: it drops the references)."""
        try:
            acks = [] if self.dead else self.acks.take()
        except Exception as e:  # noqa: BLE001 - (RingError: what the consumer wrote is broken)
            acks = []
            self._end(f"KV transfer to the consumer ended ({e}); prompts are no longer sent, and the "
                      f"blocks it may still read stay held", release=False)
        with self._lock:
            for a in acks:
                h = self.held.pop(a.decode("utf-8", "replace"), None)
                if h is None:  # the consumer is there, maybe still copying: keep the holds
                    break
                self.released.append(h[0])
                if h[1] >= 0:
                    self.free_slots.append(h[1])
            out, self.released = self.released, []
        if acks and h is None:
            self._end(f"KV transfer to the consumer ended (acknowledgement of an unknown transfer "
                      f"{a[:40]!r}); prompts are no longer sent, and the blocks it may still read stay held",
                      release=False)
        return out

    def _watch(self) -> None:
        """Waits on the channel, which carries nothing after connect but the consumer's word that
        it ended the transfer and reads no more, to learn the consumer's end."""
        try:
            meta, _ = self.channel.recv_message(0, tag=ACK)
        except ProtocolError as e:  # the consumer is there and wrote garbage: it may still be copying
            self._end(f"KV transfer to the consumer ended ({e}); prompts are no longer sent, and the blocks it "
                      f"may still read stay held", release=False)
            return
        except Exception as e:  # the channel failed: the consumer's process is gone
            self._end(f"KV transfer to the consumer ended; prompts are no longer sent: {e!r}")
            return
        if isinstance(meta.get("end"), str):  # (sent once its last copy completed)
            self._end(f"the consumer ended the KV transfer ({meta['end'][:300]}); prompts are no longer sent")
        else:
            self._end("KV transfer to the consumer ended (an unexpected message); prompts are no longer sent, "
                      "and the blocks it may still read stay held", release=False)

    def _end(self, why: str, release: bool = True, locked: bool = False) -> None:
        """No acknowledgement will come. ``release``: the consumer can no longer read the held
        blocks (its process is gone, or it said so), so they are released; else they stay held
        for good (a bounded loss of pool space, where releasing could hand the consumer reused
        blocks). ``locked``: the caller holds the lock."""
        if not locked:
            with self._lock:
                return self._end(why, release, locked=True)
        if not self.dead:
            log.error("%s", why)
        self.dead = True
        if release:
            self.released.extend(h[0] for h in self.held.values())
            self.held.clear()


class IpcConsumer(Consumer):
    """The consumer's half: maps the producer's pool and lands transfers in its own."""

    def __init__(self, channel: Channel, store, timeout_s: float, pool: torch.Tensor, clock=time.monotonic):
        try:
            meta, _ = channel.recv_message(0)
        except Exception as e:
            channel.close()
            raise ConfigError("kv_transfer_config", f"the producer left while connecting: {e}"[:500]) from None
        if meta.get("pool") is None:  # the producer refused its own configuration (and says why itself)
            channel.close()
            raise ConfigError("kv_transfer_config.kv_buffer_size", "the producer could not share its KV pool "
                              "(see its log)")
        try:
            shape = meta.get("shape")
            if (not isinstance(shape, list) or len(shape) != pool.dim() or meta.get("dtype") != str(pool.dtype)
                    or not all(type(s) is int and s > 0 for s in shape)
                    or shape[:2] != list(pool.shape[:2]) or shape[3:] != list(pool.shape[3:])):
                raise ValueError(f"the producer's pool {shape!r:.200} {meta.get('dtype')!r:.30} does not have this "
                                 f"pool's layout {list(pool.shape)} {pool.dtype}")
            buffer = SharedBuffer.open(meta["pool"])
            if buffer.nbytes != pool.element_size() * torch.Size(shape).numel():
                raise ValueError(f"the producer's pool is {buffer.nbytes} bytes, not {shape}")
            remote = buffer.tensor.view(pool.dtype).view(shape)  # (another GPU of the host: read as peer memory)
            if remote.device.type != pool.device.type:
                raise ValueError(f"the producer's pool is on {remote.device.type}, this one on {pool.device.type}")
            self.data, self.acks = self._open_rings(meta)
            self.events = self._open_events(meta.get("events"), pool.device)
        except Exception as e:  # (not the same host, GPUs or user; another torch)
            channel.send_message({"attached": False, "error": f"{type(e).__name__}: {e}"[:400]})
            channel.close()
            raise ConfigError("kv_transfer_config", f"cannot map the producer's KV pool (CudaIpcConnector links "
                              f"two processes of one host, as one user): {e}"[:500]) from None
        channel.send_message({"attached": True})
        self.buffer: SharedBuffer | None = buffer
        self.remote: torch.Tensor | None = remote
        self.inbox: deque[tuple[str, int, list[int], list[bytes]]] = deque()
        self.unacked: deque[tuple[object, str]] = deque()  # (copy finished event, transfer id)
        self.acks_waiting: deque[bytes] = deque()  # (the ring was full: sent at the next landing)
        self.partial_transfers = 0
        self.ended: str | None = None  # why this side ended the transfer (the producer is told)
        super().__init__(channel, store, timeout_s, clock)

    def _open_rings(self, meta: dict) -> tuple[Ring, Ring]:
        sizes = meta.get("rings")
        if not isinstance(sizes, list) or len(sizes) != 3 or not all(type(s) is int and s > 0 for s in sizes):
            raise ValueError(f"bad message rings {str(sizes)[:100]}")
        self.mailbox = SharedBuffer.open(meta.get("mailbox") if isinstance(meta.get("mailbox"), dict) else {})
        if self.mailbox.nbytes != ring_bytes(sizes[0]) + ring_bytes(sizes[2]):
            raise ValueError(f"the message rings are {self.mailbox.nbytes} bytes, not {sizes}")
        return _ring_views(self.mailbox, *sizes)

    @staticmethod
    def _open_events(handles, device: torch.device) -> list:
        if not isinstance(handles, list) or len(handles) > 1024 or not all(isinstance(h, str) for h in handles):
            raise ValueError("bad CUDA event handles")
        if handles and device.type != "cuda":
            raise ValueError("the producer shares CUDA events and this pool is not on a GPU")
        return [torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(h)) for h in handles]

    def _receiver(self) -> None:
        """Waits on the channel, which carries nothing after connect, to learn the producer's end
        (the transfers come through the data ring)."""
        try:
            self.channel.recv_message(0, tag=DATA)
            why = "a message on the closed channel"
        except Exception as e:  # noqa: BLE001 - the producer is gone
            why = str(e)
        if not self.dead:
            log.warning("KV transfer from the producer stopped; prompts are computed here: %s", why)
        self.dead = True

    def receive(self) -> int:
        """Engine thread: move what the data ring holds into ``inbox``; the number of transfers."""
        if self.dead or self.remote is None:
            return 0
        try:
            got = [decode_transfer(m, self.remote.shape[2], len(self.events)) for m in self.data.take()]
        except Exception as e:  # noqa: BLE001 - (RingError: the producer broke the protocol)
            self._stop(str(e))
            return 0
        self.inbox.extend(got)
        return len(got)

    def _stop(self, why: str) -> None:
        """End the transfer from this side: nothing more is taken or read from the producer; the
        copies in flight are acknowledged as they complete, then the producer is told (``land``),
        and releases what it held (its transfers not landed here are computed here)."""
        if not self.dead:
            log.warning("KV transfer from the producer stopped; prompts are computed here: %s", why)
        self.ended, self.dead = why[:300], True
        self.inbox.clear()

    def land(self, pool, data: torch.Tensor | None, spill=None) -> None:
        """Engine thread: copy what arrived into this engine's pool (``pool``: its BlockPool,
        ``data``: its KV tensor as it is now, a wake allocates a new one; None while asleep: the
        transfers wait) and acknowledge the copies that finished. ``spill(evicted)``: called with
        the (block, key) pairs whose cached KV the allocation evicted, before they are overwritten
        (the tiers copy them out then: recorded for the next step, they would be copied after the
        landing wrote over them, a wrong block under its key)."""
        self.receive()
        while self.inbox and data is not None:
            if self.dead:  # (the producer's memory may be gone: nothing more is read from it)
                self.inbox.clear()
                break
            self._land(pool, data, spill, *self.inbox.popleft())
        while self.unacked and (self.unacked[0][0] is None or self.unacked[0][0].query()):
            self.acks_waiting.append(self.unacked.popleft()[1].encode())
        try:
            while self.acks_waiting and self.acks.put(self.acks_waiting[0]):
                self.acks_waiting.popleft()
        except Exception as e:  # noqa: BLE001 - (RingError: the producer broke the protocol)
            self.acks_waiting.clear()
            self._stop(str(e))
        if self.dead and not self.unacked and self.remote is not None:
            self.remote = self.buffer = None  # (unmapped once no copy of ours reads it)
            self.events = []
            if self.ended is not None:  # (from a thread: a send may wait for the producer)
                threading.Thread(target=self._tell_end, daemon=True, name="kv-transfer-end").start()

    def _tell_end(self) -> None:
        try:
            self.channel.send_message({"end": self.ended}, tag=ACK)
        except Exception:  # noqa: BLE001 - the producer is gone: nothing to tell
            pass

    def _land(self, pool, data: torch.Tensor, spill, tid: str, slot: int, src: list[int], keys: list[bytes]) -> None:
        found = [pool.lookup(k) for k in keys]
        cached = [b for b in found if b is not None]
        if cached:
            todo = [k for k, b in zip(keys, found) if b is None]
            srcs = [s for s, b in zip(src, found) if b is None]
        else:
            todo, srcs = keys, src
        pool.touch(cached)  # (this landing's own allocation must not evict them)
        landed = 0
        try:
            n = min(len(todo), pool.num_free_blocks)
            mark = len(pool.evicted)
            dst = pool.allocate(n)
            try:
                if len(pool.evicted) > mark:
                    evicted = pool.evicted[mark:]
                    del pool.evicted[mark:]
                    if spill is not None:
                        spill(evicted)
                if n and slot >= 0:  # (the device waits for the producer's step: the host does not)
                    torch.cuda.current_stream(data.device).wait_event(self.events[slot])
                copy_blocks(self.remote, data, srcs[:n], dst)
            except BaseException:
                pool.free(dst[::-1])  # (no key registered: plain free blocks again)
                raise
            for d, k in zip(dst, todo):
                pool.cache_block(d, k)
            pool.free(dst[::-1])  # (a prompt's first blocks, which more requests share, evicted last)
            landed = len(cached) + n
            self.partial_transfers += n < len(todo)
            self.received_blocks += n
        except Exception:  # noqa: BLE001 - a failed landing costs its request the prompt, not the engine
            log.exception("KV transfer %s could not be landed; its request computes its prompt", tid[:40])
            self.failed_transfers += 1
        finally:
            pool.free(cached[::-1])
            done = None
            if data.is_cuda:  # (acknowledged once the copy finished: the producer may reuse the blocks then)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(data.device))
            self.unacked.append((done, tid))
            self.done[tid] = landed
            while len(self.done) > 4096:
                self.done.popitem(last=False)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "partial_transfers": self.partial_transfers}
