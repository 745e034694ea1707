"""``CudaIpcConnector``: disaggregated prefill and decode between two processes of one host. The
consumer maps the producer's whole KV pool and copies a prompt's blocks straight out of it into
its own: one device-to-device copy per byte, no buffer in between, no trip through host memory.

    connect   the gloo channel of kvserve/kvtier/transfer.py (control messages only) checks the
              layouts; the producer's pool was allocated shareable (``SharedBuffer``: device
              memory with CUDA IPC, or a host file); it sends the handle and the pool's shape,
              the consumer maps it and answers whether it could
    producer  engine thread, a request finished: its prompt's blocks are *held* (one more
              reference each in the producer's pool, so they are neither reused nor evicted),
              at most ``kv_buffer_size`` bytes at a time; sender thread: once the device wrote
              them, {id, keys, blocks} (tag 0); ack thread: an acknowledgement {ack: id} (tag 1)
              queues the transfer's blocks for release, which the engine thread does at its next
              step (``take_released``)
    consumer  receiver thread: checks each message and queues it; engine thread (``land``, at
              each step and when idle, not while asleep): for the keys not cached here it
              allocates blocks, copies producer -> consumer (kvserve/kernels/block_copy.py on a
              GPU), registers them in the prefix cache under their keys (free and cached: the
              request's prefix lookup revives them); ack thread: the acknowledgement of each
              transfer whose copy is complete (network I/O never waits in the engine thread)

Invariants: a held block is referenced by the producer's pool until its acknowledgement, or the
end of the consumer's process, releases it, so the consumer never reads a block the producer
reuses (a consumer that breaks the protocol but may still be copying leaves its blocks held for
good); the consumer acknowledges only after its copy finished. Landing takes free blocks of the
consumer's pool and gives them back as cached ones, so it never takes room from a running
request, and it holds the transfer's blocks that were cached here already while it allocates;
when the pool has fewer free blocks than a transfer, the first ones land (keys are chained: a
prefix of them is still a prefix hit) and the rest is computed.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque

import torch

from kvserve.errors import ConfigError
from kvserve.kvtier.ipc_buffer import SharedBuffer
from kvserve.kvtier.transfer import Channel, Consumer, ProtocolError

log = logging.getLogger(__name__)

DATA, ACK = 0, 1  # channel tags: producer -> consumer messages, consumer -> producer acknowledgements


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
        ids = torch.tensor(sources + dests, dtype=torch.int64).view(2, -1)
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


class IpcProducer:
    """The producer's half: holds blocks for the consumer and releases them when told."""

    def __init__(self, channel: Channel, pool: SharedBuffer, shape: tuple[int, ...], dtype: torch.dtype,
                 block_bytes: int, buffer_bytes: float):
        self.channel, self.block_bytes, self.device = channel, block_bytes, pool.tensor.device
        self.max_blocks = int(buffer_bytes) // block_bytes
        try:
            if self.max_blocks < 1:
                raise ConfigError("kv_transfer_config.kv_buffer_size", f"{int(buffer_bytes)} bytes cannot hold one "
                                  f"KV block ({block_bytes} bytes) for the consumer")
            channel.send_message({"pool": pool.handle, "shape": list(shape), "dtype": str(dtype)})
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
        if not reply.get("attached"):
            channel.close()
            raise ConfigError("kv_transfer_config", f"the consumer could not map this producer's KV pool "
                              f"(CudaIpcConnector links two processes of one host): {reply.get('error')}"[:500])
        self.held: dict[str, list[int]] = {}  # transfer id -> its blocks, until acknowledged
        self.released: list[list[int]] = []
        self.sent_blocks = self.dropped = 0
        self.dead = False
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._sender, daemon=True, name="kv-transfer-send").start()
        threading.Thread(target=self._acks, daemon=True, name="kv-transfer-acks").start()

    @property
    def held_blocks(self) -> list[int]:
        """Every block this side still references: held, or released and not yet taken."""
        with self._lock:
            return [b for ids in (*self.held.values(), *self.released) for b in ids]

    def send(self, tid: str, keys: list[bytes], blocks: list[int]) -> bool:
        """Offer ``blocks`` (the caller took a reference on each) under ``keys``; False: not sent
        (the consumer is gone, or more would be held than ``kv_buffer_size``), the caller drops
        its references again."""
        with self._lock:
            if self.dead or sum(map(len, self.held.values())) + len(blocks) > self.max_blocks:
                self.dropped += 1
                return False
            self.held[tid] = blocks
        ready = None  # the sender waits until the device finished writing them
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._queue.put((tid, keys, blocks, ready))
        return True

    def take_released(self) -> list[list[int]]:
        """Blocks whose transfers ended (engine thread: it drops the references)."""
        with self._lock:
            out, self.released = self.released, []
        return out

    def _sender(self) -> None:
        while True:
            tid, keys, blocks, ready = self._queue.get()
            try:
                if self.dead:
                    continue
                if ready is not None:
                    ready.synchronize()
                self.channel.send_message({"id": tid, "keys": [k.hex() for k in keys], "blocks": blocks}, tag=DATA)
                self.sent_blocks += len(blocks)
            except Exception as e:  # the consumer is gone: nothing more can be sent
                self._end(f"KV transfer to the consumer failed; prompts are no longer sent: {e}")

    def _acks(self) -> None:
        while True:
            try:
                meta, _ = self.channel.recv_message(0, tag=ACK)
                with self._lock:
                    ids = self.held.pop(str(meta.get("ack")), None)
                    if ids is not None:
                        self.released.append(ids)
                if ids is None:
                    raise ProtocolError(f"acknowledgement of an unknown transfer {str(meta.get('ack'))[:40]!r}")
            except ProtocolError as e:  # the consumer is there, maybe still copying: keep the holds
                self._end(f"KV transfer to the consumer ended ({e}); prompts are no longer sent, and the "
                          f"blocks it may still read stay held", release=False)
                return
            except Exception as e:  # the channel failed: the consumer's process is gone
                self._end(f"KV transfer to the consumer ended; prompts are no longer sent: {e!r}")
                return

    def _end(self, why: str, release: bool = True) -> None:
        """No acknowledgement will come. ``release``: the consumer can no longer read the held
        blocks (its process is gone), so they are released; else they stay held for good (a
        bounded loss of pool space, where releasing could hand the consumer reused blocks)."""
        with self._lock:
            if not self.dead:
                log.error("%s", why)
            self.dead = True
            if release:
                self.released.extend(self.held.values())
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
        except Exception as e:  # (not the same host, GPUs or user; another torch)
            channel.send_message({"attached": False, "error": f"{type(e).__name__}: {e}"[:400]})
            channel.close()
            raise ConfigError("kv_transfer_config", f"cannot map the producer's KV pool (CudaIpcConnector links "
                              f"two processes of one host, as one user): {e}"[:500]) from None
        channel.send_message({"attached": True})
        self.buffer: SharedBuffer | None = buffer
        self.remote: torch.Tensor | None = remote
        self.inbox: deque[tuple[str, list[bytes], list[int]]] = deque()
        self.unacked: deque[tuple[object, str]] = deque()  # (copy finished event, transfer id)
        self.partial_transfers = 0
        self._acks_out: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(channel, store, timeout_s, clock)
        threading.Thread(target=self._ack_sender, daemon=True, name="kv-transfer-acks").start()

    def _receiver(self) -> None:
        n = self.remote.shape[2]
        while True:
            try:
                meta, _ = self.channel.recv_message(0, tag=DATA)
                tid, keys, blocks = str(meta["id"])[:200], [bytes.fromhex(k) for k in meta["keys"]], meta["blocks"]
                if (not isinstance(blocks, list) or len(blocks) != len(keys)
                        or not all(type(b) is int and 0 <= b < n for b in blocks)):
                    raise RuntimeError(f"transfer {tid!r:.40}: {len(keys)} keys, blocks {str(blocks)[:100]}")
            except Exception as e:
                if not self.dead:
                    log.warning("KV transfer from the producer stopped; prompts are computed here: %s", e)
                self.dead = True
                return
            self.inbox.append((tid, keys, blocks))

    def _ack_sender(self) -> None:
        """Acknowledgements leave from here, never from the engine thread: a send waits for the
        producer to take it, and a paused producer must not stall the steps."""
        while True:
            tid = self._acks_out.get()
            try:
                self.channel.send_message({"ack": tid}, tag=ACK)
            except Exception as e:  # noqa: BLE001 - the producer is gone; its requests compute here
                if not self.dead:
                    log.warning("KV transfer acknowledgement failed; prompts are computed here: %s", e)
                self.dead = True
                return

    def land(self, pool, data: torch.Tensor | None, spill=None) -> None:
        """Engine thread: copy what arrived into this engine's pool (``pool``: its BlockPool,
        ``data``: its KV tensor as it is now, a wake allocates a new one; None while asleep: the
        transfers wait) and acknowledge the copies that finished. ``spill(evicted)``: called with
        the (block, key) pairs whose cached KV the allocation evicted, before they are overwritten
        (the tiers copy them out then: recorded for the next step, they would be copied after the
        landing wrote over them, a wrong block under its key)."""
        while self.inbox and data is not None:
            if self.dead:  # (the producer's memory may be gone: nothing more is read from it)
                self.inbox.clear()
                break
            self._land(pool, data, spill, *self.inbox.popleft())
        while self.unacked and (self.unacked[0][0] is None or self.unacked[0][0].query()):
            self._acks_out.put(self.unacked.popleft()[1])
        if self.dead and not self.unacked and self.remote is not None:
            self.remote = self.buffer = None  # (unmapped once no copy of ours reads it)

    def _land(self, pool, data: torch.Tensor, spill, tid: str, keys: list[bytes], src: list[int]) -> None:
        found = [pool.lookup(k) for k in keys]
        cached = [b for b in found if b is not None]
        todo = [k for k, b in zip(keys, found) if b is None]
        srcs = [s for s, b in zip(src, found) if b is None]
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
