"""Disaggregated prefill and decode: a prefill instance (producer) hands each finished prompt's
full KV blocks to a decode instance (consumer), keyed by the prefix cache's chained block hashes.

    producer engine thread: request finished -> blocks of its prompt copied out -> send queue
    producer sender thread: [header | keys | block bytes] --torch.distributed--> consumer
    consumer receiver thread: -> the store's staging memory (``TieredStore.staging``), by key
    consumer scheduler: a request marked ``do_remote_prefill`` waits in the queue (others run)
        until its keys are in memory, its transfer ended, or ``transfer_timeout_s``; then the
        tiers' ``take_run`` loads what arrived as prefix hits and the rest is computed.

The bytes sent are the blocks as stored (``KVCache.data[:, :, block]``, any KV format), so both
sides must agree on the layout; the handshake at connect time compares it and refuses a
mismatch. A transfer that never arrives (producer gone, timeout) costs the request its prompt
computed locally, never a wrong token: a key names the exact tokens, model and format of its KV,
and a block is stored only once all of its transfer's bytes arrived.

Invariants: one sender thread and one receiver thread, so messages arrive in the order sent;
after a failed send or receive the channel is dead for good (requests stop waiting at once).
``CudaIpcConnector`` (kvserve/kvtier/ipc.py) subclasses the consumer and uses the same channel
for its control messages; the bytes never cross it: the consumer copies them out of the
producer's KV pool, which it maps.
"""
from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict

import torch

from kvserve.errors import ConfigError

log = logging.getLogger(__name__)

MAGIC = 0x6B76786672  # "kvxfr": the first word of every message
LAYOUT_FIELDS = ("kv_cache_dtype", "block_size", "block_shape", "dtype", "cache_key")
_MAX_META = 1 << 24  # bytes of a message's key list (2^24 / 34 chars per key: ~490k blocks)


def check_layouts(mine: dict, theirs: dict, peer: str) -> None:
    """Refuse a peer whose KV blocks are not byte-compatible with ours, naming the first field
    that differs (kv_cache_dtype and block_size first: the ones a user sets)."""
    for name in LAYOUT_FIELDS:
        if mine.get(name) != theirs.get(name):
            raise ConfigError(f"kv_transfer_config ({name})", f"the {peer} has {theirs.get(name)!r}, this instance "
                              f"{mine.get(name)!r}; producer and consumer must run the same model with the same "
                              f"kv_cache_dtype and block_size")


class ProtocolError(RuntimeError):
    """The peer is there but sent what this protocol does not allow (as opposed to a channel that
    failed: the peer's process gone)."""


class Channel:
    """torch.distributed point to point between the two instances: gloo between CPU processes,
    NCCL between GPUs (one code path). Rank 0 (the producer) hosts the rendezvous store at
    ``kv_ip:kv_port``."""

    def __init__(self, cfg, device: torch.device):
        from torch import distributed as dist
        self.rank, self.peer = cfg.rank, 1 - cfg.rank
        self.device = device if device.type == "cuda" else torch.device("cpu")
        connect = datetime.timedelta(seconds=cfg.extra("connect_timeout_s"))
        try:
            store = dist.TCPStore(cfg.kv_ip, cfg.kv_port, 2, self.rank == 0, connect)
            # Operations never time out by themselves: the receiver waits for the next message
            # as long as the producer lives; a peer that dies closes the pair, which fails them.
            if self.device.type == "cuda":
                self.pg = dist.ProcessGroupNCCL(store, self.rank, 2)
            else:
                self.pg = dist.ProcessGroupGloo(store, self.rank, 2, datetime.timedelta(days=365))
        except (RuntimeError, ValueError, OSError) as e:
            raise ConfigError("kv_transfer_config", f"cannot connect to the peer at {cfg.kv_ip}:{cfg.kv_port} "
                              f"as kv_rank {self.rank}: {e}"[:500]) from None
        self.store = store  # kept alive: the rendezvous server lives in the producer's

    def send(self, t: torch.Tensor, tag: int = 0) -> None:
        self.pg.send([t.to(self.device).contiguous()], self.peer, tag).wait()

    def recv(self, numel: int, dtype: torch.dtype, tag: int = 0) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self.pg.recv([t], self.peer, tag).wait()
        return t

    def send_message(self, meta: dict, payload: torch.Tensor | None = None, tag: int = 0) -> None:
        """[MAGIC, payload bytes, meta bytes] then the meta JSON, then the payload (uint8). Each
        direction of a conversation has its own ``tag`` when two threads use the channel."""
        m = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        n = 0 if payload is None else payload.numel()
        self.send(torch.tensor([MAGIC, n, m.numel()], dtype=torch.int64), tag)
        self.send(m, tag)
        if n:
            self.send(payload, tag)

    def recv_message(self, max_payload: int, tag: int = 0) -> tuple[dict, torch.Tensor | None]:
        magic, n, m = self.recv(3, torch.int64, tag).tolist()
        if magic != MAGIC or not 0 < m <= _MAX_META or not 0 <= n <= max_payload:
            raise ProtocolError(f"bad KV transfer header {magic:#x}/{n}/{m}")
        try:
            meta = json.loads(bytes(self.recv(m, torch.uint8, tag).cpu().numpy()))
        except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError both)
            raise ProtocolError(f"bad KV transfer message: {e}"[:200]) from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"bad KV transfer message: {type(meta).__name__}, not an object")
        return meta, (self.recv(n, torch.uint8, tag) if n else None)

    def handshake(self, layout: dict) -> None:
        """Exchange layouts (producer first) and refuse a mismatch on both sides."""
        if self.rank == 0:
            self.send_message(layout)
            theirs, _ = self.recv_message(0)
        else:
            theirs, _ = self.recv_message(0)
            self.send_message(layout)
        try:
            check_layouts(layout, theirs, "consumer" if self.rank == 0 else "producer")
        except ConfigError:
            self.close()
            raise

    def close(self) -> None:
        """Drop the connection now (not when the last reference to the channel goes), so the
        peer's process can end."""
        self.pg = self.store = None


class Producer:
    """Sends the KV of finished prompts in the background of the engine's steps. At most
    ``buffer_bytes`` wait to be sent; beyond that a prompt is not sent (its consumer computes it)."""

    def __init__(self, channel: Channel, block_bytes: int, buffer_bytes: float):
        self.channel, self.block_bytes, self.buffer_bytes = channel, block_bytes, buffer_bytes
        self.queued_bytes = 0
        self.sent_blocks = self.dropped = 0
        self.dead = False
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._sender, daemon=True, name="kv-transfer-send").start()

    def send(self, keys: list[bytes], blocks: torch.Tensor) -> str | None:
        """Queue ``blocks`` (``[n, *block_shape]``, a copy the caller no longer writes) under
        ``keys``; returns the transfer id the consumer's request names, None if not sent."""
        nbytes = blocks.numel() * blocks.element_size()
        with self._lock:
            if self.dead or self.queued_bytes + nbytes > self.buffer_bytes:
                self.dropped += 1
                return None
            self.queued_bytes += nbytes
        tid = uuid.uuid4().hex
        # The sender thread may copy on another CUDA stream than the engine's: it waits for this.
        ready = None
        if blocks.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(blocks.device))
        self._queue.put((tid, keys, blocks, nbytes, ready))
        return tid

    def _sender(self) -> None:
        while True:
            tid, keys, blocks, nbytes, ready = self._queue.get()
            try:
                if not self.dead:
                    if ready is not None:
                        ready.synchronize()
                    self.sent_blocks += self._deliver(tid, keys, blocks.contiguous().view(torch.uint8).reshape(-1))
            except Exception as e:  # the consumer is gone: nothing more can be sent
                log.error("KV transfer to the consumer failed; prompts are no longer sent: %s", e)
                self.dead = True
            finally:
                with self._lock:
                    self.queued_bytes -= nbytes

    def _deliver(self, tid: str, keys: list[bytes], payload: torch.Tensor) -> int:
        """Send one transfer's blocks (``payload``: their bytes); returns the blocks sent."""
        self.channel.send_message({"id": tid, "keys": [k.hex() for k in keys]}, payload)
        return len(keys)


class Consumer:
    """Receives blocks into the store's staging memory and tells the scheduler which requests
    still wait for theirs."""

    def __init__(self, channel: Channel | None, store, timeout_s: float, clock=time.monotonic):
        self.channel, self.store, self.timeout_s, self.clock = channel, store, timeout_s, clock
        self.done: OrderedDict[str, int] = OrderedDict()  # transfer id -> blocks stored (recent ones)
        self.received_blocks = self.failed_transfers = self.timeouts = 0
        self.dead = channel is None
        if channel is not None:
            threading.Thread(target=self._receiver, daemon=True, name="kv-transfer-recv").start()

    def _receiver(self) -> None:
        shape, dtype = self.store.block_shape, self.store.dtype
        limit = int(self.store.staging.capacity)
        while True:
            try:
                meta, payload = self._receive(limit)
                keys = [bytes.fromhex(k) for k in meta["keys"]]
                if (payload is None and keys) or (payload is not None and
                                                  payload.numel() != len(keys) * self.store.chunk_bytes):
                    raise RuntimeError(f"transfer {meta.get('id')!r}: {len(keys)} keys, "
                                       f"{0 if payload is None else payload.numel()} bytes")
                blocks = None if payload is None else payload.view(dtype).view((len(keys),) + tuple(shape))
            except Exception as e:
                if not self.dead:
                    log.warning("KV transfer from the producer stopped; prompts are computed here: %s", e)
                self._stopped()  # (first: whoever sees ``dead`` sees what it released)
                self.dead = True
                return
            n = sum(self.store.staging.put(k, blocks[i].clone(), tag="remote") for i, k in enumerate(keys))
            self.received_blocks += n
            self.done[str(meta["id"])] = n
            while len(self.done) > 4096:
                self.done.popitem(last=False)

    def _receive(self, limit: int) -> tuple[dict, torch.Tensor | None]:
        """The next transfer: its message and its bytes in host memory (None: it carries no
        blocks, the producer gave it up and its request computes its prompt)."""
        meta, payload = self.channel.recv_message(limit)
        return meta, None if payload is None else payload.cpu()

    def _stopped(self) -> None:
        """The receiver ended (the producer is gone or broke the protocol)."""

    def waiting(self, req, keys: list[bytes]) -> bool:
        """Whether ``req`` (a request marked ``do_remote_prefill``) should wait longer for the
        producer's blocks of ``keys`` (its prompt blocks not cached here)."""
        params = req.params.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or params.get("num_blocks") == 0
                or req.kv_transfer_until == -1.0):
            return False
        now = self.clock()
        if req.kv_transfer_until is None:
            req.kv_transfer_until = now + self.timeout_s
        if self.arrived(params.get("transfer_id"), keys):
            req.kv_transfer_until = -1.0
            return False
        if self.dead or now >= req.kv_transfer_until:
            self.timeouts += not self.dead
            self.failed_transfers += 1
            req.kv_transfer_until = -1.0
            return False
        return True

    def arrived(self, transfer_id, keys: list[bytes]) -> bool:
        return transfer_id in self.done or all(self.store.in_memory(k) for k in keys)

    def snapshot(self) -> dict:
        return {"received_blocks": self.received_blocks, "failed_transfers": self.failed_transfers,
                "timeouts": self.timeouts, "connected": not self.dead}


class TierConsumer(Consumer):
    """KVTierConnector's consumer: the producer writes its blocks through to disk or Redis; a
    request waits until its last prompt block is there (blocks are written in order), then the
    tiers' prefetch loads them."""

    def __init__(self, store, timeout_s: float, clock=time.monotonic):
        super().__init__(None, store, timeout_s, clock)
        self.dead = False

    def arrived(self, transfer_id, keys: list[bytes]) -> bool:
        last = keys[-1]
        if self.store.in_memory(last):
            return True
        disk, redis = self.store.disk, self.store.redis
        if disk is not None and disk.adopt(last):
            for k in keys[:-1]:
                disk.adopt(k)
            return True
        return redis is not None and redis.contains(last)
