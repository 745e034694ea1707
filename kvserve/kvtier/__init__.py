"""Tiered KV store: KV blocks leave the GPU for pinned CPU memory, a disk directory and Redis,
and come back instead of being recomputed when that is cheaper.

Chunks are content-addressed by the prefix cache's chained block hash (model, KV dtype and every
token before and in the block), so any process computes the same key for the same tokens, and a
chunk written by one replica (or before a restart) serves another. Disk and Redis chunks are
authenticated with a secret (``secret.py``) and, optionally, encrypted (``chunk.py``).
"""
from kvserve.kvtier.chunk import ChunkCodec, ChunkError
from kvserve.kvtier.store import TieredStore

__all__ = ["ChunkCodec", "ChunkError", "TieredStore"]
