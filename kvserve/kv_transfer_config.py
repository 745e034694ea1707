"""Disaggregated prefill and decode: one instance's side of the KV hand-over, with vLLM's field
names (``--kv-transfer-config``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.errors import ConfigError, check_option_dict

KV_CONNECTORS = ("TorchDistributedConnector", "CudaIpcConnector", "KVTierConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_EXTRA_KEYS = ("transfer_timeout_s", "connect_timeout_s")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill and decode (kvserve/kvtier/transfer.py, ipc.py), with vLLM's names. A
    producer (prefill instance) hands each finished prompt's full KV blocks, keyed by their chained
    block hashes, to a consumer (decode instance), which loads them as prefix hits.

    ``TorchDistributedConnector``: one producer (``kv_rank`` 0) and one consumer (``kv_rank`` 1)
    meet at ``kv_ip:kv_port`` (the producer listens) and send blocks with torch.distributed
    (gloo on the CPU, NCCL on CUDA). ``CudaIpcConnector``: the same pair, two processes of one
    host (one GPU, which NCCL cannot share between two ranks, or two GPUs of the host): the
    producer's KV pool is shared (CUDA IPC; a host file on the CPU), a finished prompt's blocks are
    held there until the consumer copied them into its own pool, at most ``kv_buffer_size`` bytes
    at a time (a prompt beyond that is not sent: its consumer computes it), gloo at
    ``kv_ip:kv_port`` carrying only block numbers, keys and acknowledgements.
    ``KVTierConnector``: the producer writes through to the disk or Redis tier both instances are
    configured with; the consumer loads by hash from there.
    ``kv_connector_extra_config``: ``transfer_timeout_s`` (how long a request waits for its KV
    before computing its prompt itself, default 30), ``connect_timeout_s`` (default 300)."""
    kv_connector: str
    kv_role: str
    kv_rank: int | None = None  # None: 0 for a producer, 1 for a consumer
    kv_parallel_size: int = 2
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # bytes of KV in flight or waiting to load (CudaIpcConnector: held by the producer)
    kv_connector_extra_config: dict = field(default_factory=dict, hash=False)
    kv_load_failure_policy: str = "recompute"  # KV that does not arrive: the consumer computes it

    _FIELDS = ("kv_connector", "kv_role", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_buffer_size",
               "kv_connector_extra_config", "kv_load_failure_policy")

    @classmethod
    def from_dict(cls, d) -> KVTransferConfig:
        """``kv_transfer_config`` as the user wrote it (a dict or JSON text, as in vLLM)."""
        if isinstance(d, str):
            import json
            try:
                d = json.loads(d)
            except ValueError as e:
                raise ConfigError("kv_transfer_config", f"is not JSON: {e}") from None
        check_option_dict(d, "kv_transfer_config", cls._FIELDS, ("kv_connector", "kv_role"))
        return cls(**d)

    @property
    def rank(self) -> int:
        return self.kv_rank if self.kv_rank is not None else (0 if self.is_producer else 1)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, name: str) -> float:
        return self.kv_connector_extra_config.get(name, {"transfer_timeout_s": 30.0, "connect_timeout_s": 300.0}[name])

    def __post_init__(self):
        def bad(name, msg):
            raise ConfigError(f"kv_transfer_config.{name}", msg)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if self.kv_connector not in KV_CONNECTORS:
            bad("kv_connector", f"must be one of {', '.join(KV_CONNECTORS)}; got {self.kv_connector!r}"[:300])
        if self.kv_role not in KV_ROLES:
            bad("kv_role", f"must be one of {', '.join(KV_ROLES)}; got {self.kv_role!r}"[:300])
        if not is_int(self.kv_parallel_size) or self.kv_parallel_size != 2:
            bad("kv_parallel_size", f"must be 2 (one producer, one consumer), got {self.kv_parallel_size!r}"[:300])
        if self.kv_rank is not None and not (is_int(self.kv_rank) and 0 <= self.kv_rank < self.kv_parallel_size):
            bad("kv_rank", f"must be an integer in [0, {self.kv_parallel_size - 1}], got {self.kv_rank!r}"[:300])
        if self.kv_connector in ("TorchDistributedConnector", "CudaIpcConnector"):
            if self.kv_role == "kv_both":
                bad("kv_role", f"'kv_both' needs a shared store (KVTierConnector); {self.kv_connector} "
                    "links one kv_producer to one kv_consumer")
            want = 0 if self.kv_role == "kv_producer" else 1
            if self.kv_rank is not None and self.kv_rank != want:
                bad("kv_rank", f"must be {want} for a {self.kv_role} (the producer is rank 0), got {self.kv_rank}")
        if not isinstance(self.kv_ip, str) or not 0 < len(self.kv_ip) <= 253 or any(c.isspace() for c in self.kv_ip):
            bad("kv_ip", f"must be a host name or IP address, got {self.kv_ip!r}"[:300])
        if not is_int(self.kv_port) or not 1 <= self.kv_port <= 65535:
            bad("kv_port", f"must be an integer in [1, 65535], got {self.kv_port!r}"[:300])
        if not is_num(self.kv_buffer_size) or not 2**20 <= self.kv_buffer_size <= 2**50:
            bad("kv_buffer_size", f"must be a number of bytes in [2^20, 2^50], got {self.kv_buffer_size!r}"[:300])
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            bad("kv_connector_extra_config", f"must be a dict (JSON object), got {type(extra).__name__}")
        for k, v in extra.items():
            if k not in KV_EXTRA_KEYS:
                bad(f"kv_connector_extra_config.{k}"[:100], f"unknown field; known: {', '.join(KV_EXTRA_KEYS)}")
            if not is_num(v) or not 0 < v <= 86400:
                bad(f"kv_connector_extra_config.{k}", f"must be a number of seconds in (0, 86400], got {v!r}"[:300])
        if self.kv_load_failure_policy != "recompute":
            bad("kv_load_failure_policy", f"must be 'recompute', got {self.kv_load_failure_policy!r}"[:300])
