"""The stored form of one KV block: header, payload, checksum.

    b"KVSC" | version u16 | header length u32 | header (JSON) | payload | blake2b-16(all before)

The header names the chunk's key (hex), shape and dtype; a reader checks the magic, the version,
that the key is the one it asked for, that the shape and dtype are what its cache holds, the
payload length and the checksum. Any mismatch raises ``ChunkError``: the caller treats the chunk
as missing and recomputes, so a corrupted, truncated or foreign chunk can never become KV.
"""
from __future__ import annotations

import hashlib
import json
import struct

import torch

MAGIC = b"KVSC"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_SUM = 16

# uint8: a compressed cache's blocks (codes and scales as bytes; the KV format is in the key)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


class ChunkError(ValueError):
    """A stored chunk failed a check (magic, version, key, shape, dtype, size or checksum)."""


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_SUM).digest()


def encode_chunk(key: bytes, kv: torch.Tensor) -> bytes:
    """kv: one block's KV on the CPU, any shape (the cache's ``[layers, 2, block, heads, dim]``)."""
    kv = kv.contiguous()
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot store KV of dtype {kv.dtype}")
    header = json.dumps({"key": key.hex(), "shape": list(kv.shape), "dtype": dtype}).encode()
    payload = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
    body = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload
    return body + _checksum(body)


def decode_chunk(data: bytes, key: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV tensor stored in ``data``, after every check; raises ``ChunkError``."""
    if len(data) < _PREFIX.size + _SUM:
        raise ChunkError(f"chunk of {len(data)} bytes is shorter than its fixed header")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ChunkError(f"format version {version}, this build reads {VERSION}")
    body = memoryview(data)[:-_SUM]
    if _checksum(body) != data[-_SUM:]:
        raise ChunkError("checksum mismatch (corrupted or truncated chunk)")
    try:
        header = json.loads(bytes(body[_PREFIX.size:_PREFIX.size + hlen]))
    except ValueError as e:
        raise ChunkError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise ChunkError(f"header is {type(header).__name__}, not an object")
    if header.get("key") != key.hex():
        raise ChunkError(f"chunk holds key {header.get('key')}, asked for {key.hex()}")
    got_shape = header.get("shape")
    want_dtype = str(dtype).removeprefix("torch.")
    if (not isinstance(got_shape, list) or tuple(got_shape) != tuple(shape)
            or header.get("dtype") != want_dtype):
        raise ChunkError(f"chunk is {got_shape} {header.get('dtype')}, the cache holds "
                         f"{list(shape)} {want_dtype}")
    payload = body[_PREFIX.size + hlen:]
    numel = 1
    for s in shape:
        numel *= s
    if len(payload) != numel * dtype.itemsize:
        raise ChunkError(f"payload of {len(payload)} bytes, expected {numel * dtype.itemsize}")
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return t.view(dtype).view(shape)
