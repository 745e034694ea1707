"""The engine's side of disaggregated prefill and decode (``kv_transfer_config``; the transports
are in ``kvserve/kvtier/transfer.py`` and, for CudaIpcConnector, ``kvserve/kvtier/ipc.py``).

Producer: when a request finishes (a prefill run with ``max_tokens=1``), its prompt's full blocks
are still in the prefix cache under their hashes (finishing frees blocks but keeps their hashes
until the pool reuses them, and no allocation happens before this runs): they are copied out
and queued for the consumer (CudaIpcConnector: held in the pool until the consumer copied them),
and the request's output carries ``kv_transfer_params`` naming the transfer, for the decode
request to pass on.
Consumer: the tiers' connector asks ``Consumer.waiting`` before admitting a request marked
``do_remote_prefill``; what arrived is loaded like any chunk of the CPU tier (CudaIpcConnector:
it is in the prefix cache already, landed by ``poll`` before the step).
"""
from __future__ import annotations

import logging
import uuid

import torch

from kvserve.errors import ConfigError
from kvserve.kvtier.ipc import IpcConsumer, IpcProducer

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(self, engine):
        from kvserve.kvtier.transfer import Channel, Consumer, Producer, TierConsumer
        cfg = engine.config.kv_transfer_config
        if engine.kv_plan.groups.num_groups != 1:
            raise ConfigError("kv_transfer_config", f"{engine.model_name} has sliding-window KV groups; "
                              "disaggregated prefill hands over full-attention models' blocks only")
        self.cfg, self.engine = cfg, engine
        self.producer = self.consumer = None
        rt = engine.runner
        data = rt.kv_cache.data
        self.block_shape = rt.kv_cache.block_shape
        if cfg.kv_connector == "KVTierConnector":
            if cfg.is_consumer:
                self.consumer = TierConsumer(engine.store, cfg.extra("transfer_timeout_s"))
            return
        layout = {"kv_cache_dtype": engine.config.cache.kv_cache_dtype, "block_size": engine.block_size,
                  "block_shape": list(self.block_shape), "dtype": str(data.dtype),
                  "cache_key": engine.kv.hash_extra.decode(errors="replace")}
        ipc = cfg.kv_connector == "CudaIpcConnector"  # (gloo carries its control messages only)
        channel = Channel(cfg, torch.device("cpu") if ipc else data.device)
        channel.handshake(layout)
        block_bytes = data.element_size()
        for s in self.block_shape:
            block_bytes *= s
        timeout = cfg.extra("transfer_timeout_s")
        if cfg.is_producer and ipc:
            self.producer = IpcProducer(channel, engine.kv_shared, tuple(data.shape), data.dtype, block_bytes,
                                        cfg.kv_buffer_size)
        elif cfg.is_producer:
            self.producer = Producer(channel, block_bytes, cfg.kv_buffer_size)
        elif ipc:
            self.consumer = IpcConsumer(channel, engine.store, timeout, data)
        else:
            self.consumer = Consumer(channel, engine.store, timeout)

    def wants(self, req) -> bool:
        """Whether a finished request's prompt KV goes to the consumer: every request of a
        kv_producer, those asking for it (``do_remote_decode``) of a kv_both instance."""
        if self.cfg.kv_role == "kv_producer":
            return True
        p = req.params.kv_transfer_params
        return self.cfg.is_producer and bool(p and p.get("do_remote_decode"))

    def finished(self, finished: list, outputs: list) -> None:
        """Hand the prompts of requests that finished this step to the consumer (one per group)."""
        params: dict[str, dict] = {}
        for req in finished:
            if req.group_id in params or not self.wants(req) or req.status.name.endswith("ABORTED"):
                continue
            params[req.group_id] = self._send(req)
        for out in outputs:
            if out.request_id in params:
                out.kv_transfer_params = params[out.request_id]

    def _send(self, req) -> dict:
        kv = self.engine.kv
        keys = req.block_hashes[:req.num_prompt_tokens // kv.block_size]
        if self.producer is None:  # KVTierConnector: written through as computed
            return {"do_remote_prefill": True, "num_blocks": len(keys)}
        ids = []
        for k in keys:
            bid = kv.pool.lookup(k)
            if bid is None:  # (evicted by a later block of the same prompt: the rest is computed)
                break
            ids.append(bid)
        keys = keys[:len(ids)]
        tid = None
        if ids and isinstance(self.producer, IpcProducer):  # held, not copied: the consumer reads them
            kv.pool.touch(ids)
            tid = uuid.uuid4().hex
            if not self.producer.send(tid, keys, ids):
                kv.pool.free(ids[::-1])
                tid = None
        elif ids:
            data = self.engine.runner.kv_cache.data
            blocks = data.movedim(2, 0)[torch.tensor(ids, device=data.device)]  # a copy, [n, *block]
            tid = self.producer.send(keys, blocks if data.device.type == "cuda" else blocks.cpu())
        out = {"do_remote_prefill": True, "num_blocks": len(keys) if tid else 0}
        if tid is not None:
            out["transfer_id"] = tid
        return out

    def poll(self) -> None:
        """Engine thread, before each step and when idle (CudaIpcConnector): land what arrived,
        release what the consumer copied."""
        pool = self.engine.kv.pool
        if isinstance(self.consumer, IpcConsumer):
            cache = self.engine.runner.kv_cache  # (None asleep; a wake allocates a new one)
            self.consumer.land(pool, None if cache is None else cache.data, self._spill)
        elif isinstance(self.producer, IpcProducer):
            for ids in self.producer.take_released():
                pool.free(ids[::-1])

    def _spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """Cached blocks a landing is about to overwrite: to the tiers now, as the runner copies
        the step's evictions."""
        tiers = self.engine.tiers
        todo = tiers.to_offload(evicted) if tiers is not None else []
        if todo:
            tiers.offload(self.engine.runner.kv_cache.data, todo)
            tiers.stats.offloaded_blocks += len(todo)

    def held(self) -> list[int]:
        """Blocks the producer holds for the consumer (one reference each)."""
        return self.producer.held_blocks if isinstance(self.producer, IpcProducer) else []

    def snapshot(self) -> dict:
        if self.consumer is not None:
            return self.consumer.snapshot()
        p = self.producer
        return {} if p is None else {"sent_blocks": p.sent_blocks, "dropped_transfers": p.dropped,
                                     "connected": not p.dead}
