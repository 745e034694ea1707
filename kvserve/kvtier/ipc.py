"""``CudaIpcConnector``: disaggregated prefill and decode between two processes of one host, the
KV passing through memory both map instead of a network (NCCL cannot put two ranks on one GPU).

    connect   the gloo channel of kvserve/kvtier/transfer.py (control messages only) checks the
              layouts; the producer allocates its buffer of ``kv_buffer_size`` bytes once
              (kvserve/kvtier/ipc_buffer.py: device memory with CUDA IPC, or a host file) and
              sends its handle; the consumer opens it and answers whether it could
    producer  sender thread: waits for a slot of the buffer (``Ring``), copies the transfer's
              blocks into it, synchronises, sends {id, keys, offset, nbytes} (tag 0)
              ack thread: each acknowledgement (tag 1) frees the oldest slot
    consumer  receiver thread: copies the slot out to host memory, acknowledges it, then stores
              the blocks in the staging memory as the gloo transport's receiver does

Invariants: slots are used and freed in the order sent (one sender, one receiver, one ack per
slot), so the free space is one contiguous run that may wrap once. A slot is overwritten only
after its acknowledgement, which the consumer sends once its copy is complete. A transfer that
gets no slot within ``transfer_timeout_s`` is announced without blocks, so its request computes
its prompt at once instead of waiting; one larger than the whole buffer is never queued.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from kvserve.errors import ConfigError
from kvserve.kvtier.ipc_buffer import SharedBuffer
from kvserve.kvtier.transfer import Channel, Consumer, Producer

log = logging.getLogger(__name__)

DATA, ACK = 0, 1  # channel tags: producer -> consumer messages, consumer -> producer acknowledgements


class Ring:
    """Slots of a circular buffer of ``capacity`` bytes, freed in the order allocated. A slot
    never wraps around the end: when the tail is too short it starts at 0 (the tail stays unused
    until the slots before it are freed)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: deque[tuple[int, int]] = deque()  # (start, end) of each slot in use, oldest first
        self.head = 0  # the end of the last slot allocated: slots go round the whole buffer

    def alloc(self, n: int) -> int | None:
        """The offset of a new slot of ``n`` bytes (0 < n <= capacity), None if no room now."""
        fits_here = self.head + n <= self.capacity
        if not self.slots:
            start = self.head if fits_here else 0
        elif self.slots[-1][0] >= self.slots[0][0]:  # not wrapped: room up to the end, then before the first
            start = self.head if fits_here else 0 if n <= self.slots[0][0] else None
        else:  # wrapped: room between the last slot and the first
            start = self.head if self.head + n <= self.slots[0][0] else None
        if start is not None:
            self.slots.append((start, start + n))
            self.head = start + n
        return start

    def free(self, offset: int) -> None:
        """Free the oldest slot, which must start at ``offset``."""
        if not self.slots or self.slots[0][0] != offset:
            raise RuntimeError(f"acknowledgement of offset {offset}, expected "
                               f"{self.slots[0][0] if self.slots else 'none'}")
        self.slots.popleft()

    @property
    def used(self) -> int:
        return sum(e - s for s, e in self.slots)


class IpcProducer(Producer):
    def __init__(self, channel: Channel, device: torch.device, block_bytes: int, buffer_bytes: float,
                 timeout_s: float):
        nbytes = int(buffer_bytes)
        try:
            if nbytes < block_bytes:
                raise ConfigError("kv_transfer_config.kv_buffer_size", f"{nbytes} bytes cannot hold one KV block "
                                  f"({block_bytes} bytes) in CudaIpcConnector's shared buffer")
            self.buffer = SharedBuffer.create(device, nbytes)
        except Exception as e:
            channel.send_message({"buffer": None})  # (the consumer must not wait for it)
            channel.close()
            if isinstance(e, ConfigError):
                raise
            raise ConfigError("kv_transfer_config.kv_buffer_size", f"cannot create the shared KV buffer: {e}"
                              [:500]) from None
        try:
            channel.send_message({"buffer": self.buffer.handle})
            reply, _ = channel.recv_message(0)
        except Exception as e:
            channel.close()
            raise ConfigError("kv_transfer_config", f"the consumer left while connecting: {e}"[:500]) from None
        finally:
            self.buffer.unlink()
        if not reply.get("attached"):
            channel.close()
            raise ConfigError("kv_transfer_config", f"the consumer could not open this producer's KV buffer "
                              f"(CudaIpcConnector links two processes of one host): {reply.get('error')}"[:500])
        self.ring, self.timeout_s = Ring(nbytes), timeout_s
        self.refused = 0
        self._space = threading.Condition()
        super().__init__(channel, block_bytes, buffer_bytes)
        threading.Thread(target=self._acks, daemon=True, name="kv-transfer-acks").start()

    def send(self, keys: list[bytes], blocks: torch.Tensor) -> str | None:
        nbytes = blocks.numel() * blocks.element_size()
        if nbytes > self.ring.capacity:
            log.error("a prompt's KV (%d blocks, %d bytes) is larger than kv_buffer_size (%d bytes), the shared "
                      "buffer of CudaIpcConnector: not sent, the consumer computes it; raise kv_buffer_size to "
                      "hand over prompts this long", len(keys), nbytes, self.ring.capacity)
            with self._lock:
                self.refused += 1
                self.dropped += 1
            return None
        return super().send(keys, blocks)

    def _deliver(self, tid: str, keys: list[bytes], payload: torch.Tensor) -> int:
        n = payload.numel()
        deadline = time.monotonic() + self.timeout_s
        with self._space:
            while (offset := self.ring.alloc(n)) is None and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._space.wait(left)
        if self.dead:
            raise RuntimeError("the consumer is gone")
        if offset is None:  # the consumer is not freeing slots fast enough: it computes this prompt
            log.warning("no room in kv_buffer_size (%d bytes) for %d bytes of KV within %.0f s; transfer "
                        "given up", self.ring.capacity, n, self.timeout_s)
            with self._lock:
                self.dropped += 1
            self.channel.send_message({"id": tid, "keys": []}, tag=DATA)
            return 0
        self.buffer.write(offset, payload)
        self.channel.send_message({"id": tid, "keys": [k.hex() for k in keys], "offset": offset, "nbytes": n},
                                  tag=DATA)
        return len(keys)

    def _acks(self) -> None:
        while True:
            try:
                meta, _ = self.channel.recv_message(0, tag=ACK)
                with self._space:
                    self.ring.free(int(meta["ack"]))
                    self._space.notify_all()
            except Exception as e:  # the consumer is gone (or broke the protocol)
                if not self.dead:
                    log.error("KV transfer to the consumer failed; prompts are no longer sent: %s", e)
                self.dead = True
                with self._space:
                    self._space.notify_all()
                return


class IpcConsumer(Consumer):
    def __init__(self, channel: Channel, store, timeout_s: float, clock=time.monotonic):
        try:
            meta, _ = channel.recv_message(0)
        except Exception as e:
            channel.close()
            raise ConfigError("kv_transfer_config", f"the producer left while connecting: {e}"[:500]) from None
        if meta.get("buffer") is None:  # the producer could not allocate it (and says why itself)
            channel.close()
            raise ConfigError("kv_transfer_config.kv_buffer_size", "the producer could not allocate its shared "
                              "KV buffer (see its log)")
        try:
            buffer = SharedBuffer.open(meta["buffer"])
        except Exception as e:  # (not the same host, GPUs or user; another torch)
            channel.send_message({"attached": False, "error": f"{type(e).__name__}: {e}"[:400]})
            channel.close()
            raise ConfigError("kv_transfer_config", f"cannot open the producer's KV buffer (CudaIpcConnector "
                              f"links two processes of one host, as one user): {e}"[:500]) from None
        channel.send_message({"attached": True})
        self.buffer: SharedBuffer | None = buffer
        super().__init__(channel, store, timeout_s, clock)

    def _receive(self, limit: int) -> tuple[dict, torch.Tensor | None]:
        # (``limit`` bounds what a network peer could make this process allocate; here the
        # buffer's own size does, and the staging memory takes what fits.)
        meta, _ = self.channel.recv_message(0, tag=DATA)
        if not meta.get("keys"):
            return meta, None
        offset, n = meta.get("offset"), meta.get("nbytes")
        if not (isinstance(offset, int) and isinstance(n, int) and 0 <= offset and 0 < n
                and offset + n <= self.buffer.nbytes):
            raise RuntimeError(f"transfer {meta.get('id')!r}: bad slot {offset!r}+{n!r}")
        payload = self.buffer.read(offset, n)
        self.channel.send_message({"ack": offset}, tag=ACK)
        return meta, payload

    def _stopped(self) -> None:
        self.buffer = None  # (unmaps it: the producer's memory may be gone)
