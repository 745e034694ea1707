"""The stored form of one KV block, authenticated with the tiers' secret and optionally encrypted.

    b"KVSC" | version u16 | header length u32 | header (JSON) | body
    plain:     body = payload | HMAC-SHA256(mac key; block key | everything before)
    encrypted: body = nonce (12 random bytes) | AES-256-GCM(payload) with its 16-byte tag,
               associated data = block key | magic, version, header length, header

The header names the chunk's key (hex), shape, dtype and whether it is encrypted. The MAC (or,
encrypted, the GCM tag, which authenticates the same bytes: no separate MAC) covers the block key
the chunk is stored under, so a valid chunk copied under another key fails, and only a process
holding the same secret can write a chunk another will load. A reader authenticates before it
parses anything past the fixed prefix, then checks the header against what it asked for (key,
shape, dtype, its own encryption setting) and the payload length. Any failure raises
``ChunkError``: the caller drops the chunk and recomputes, so a forged, corrupted, truncated,
replayed or foreign chunk can never become KV.

Both keys are derived from the secret with HKDF-SHA256 (``cryptography``), one per use.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

import torch

MAGIC = b"KVSC"
VERSION = 2
_PREFIX = struct.Struct("<4sHI")
MAC_BYTES = 32
NONCE_BYTES = 12
GCM_TAG_BYTES = 16
ENCRYPTED = "aes-256-gcm"

# uint8: a compressed cache's blocks (codes and scales as bytes; the KV format is in the key)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


class ChunkError(ValueError):
    """A stored chunk failed a check (magic, version, authentication, key, shape, dtype, size)."""


def _derive(secret: bytes, purpose: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvserve kv tiers",
                info=b"kvserve chunk " + purpose).derive(secret)


class ChunkCodec:
    """Encodes and decodes chunks under one secret; ``encrypt``: AES-256-GCM payloads."""

    def __init__(self, secret: bytes, encrypt: bool = False):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the KV tier secret must be at least 16 bytes")
        self.encrypt = encrypt
        self._mac_key = _derive(secret, b"mac")
        self._aead = None
        if encrypt:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            self._aead = AESGCM(_derive(secret, b"aes-256-gcm"))

    def _mac(self, key: bytes, data: bytes | memoryview) -> bytes:
        m = hmac.new(self._mac_key, key, hashlib.sha256)
        m.update(data)
        return m.digest()

    def encode(self, key: bytes, kv: torch.Tensor) -> bytes:
        """kv: one block's KV on the CPU, any shape (the cache's ``[layers, 2, block, heads, dim]``)."""
        kv = kv.contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"cannot store KV of dtype {kv.dtype}")
        header = json.dumps({"key": key.hex(), "shape": list(kv.shape), "dtype": dtype,
                             "enc": ENCRYPTED if self.encrypt else "none"}).encode()
        payload = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
        head = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
        if self._aead is not None:
            nonce = os.urandom(NONCE_BYTES)  # random per chunk: 2^-32 collision odds only after 2^32 chunks
            return head + nonce + self._aead.encrypt(nonce, payload, key + head)
        body = head + payload
        return body + self._mac(key, body)

    def decode(self, data: bytes, key: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The KV tensor stored in ``data``, after every check; raises ``ChunkError``."""
        overhead = NONCE_BYTES + GCM_TAG_BYTES if self._aead is not None else MAC_BYTES
        if len(data) < _PREFIX.size + overhead:
            raise ChunkError(f"chunk of {len(data)} bytes is shorter than its fixed parts")
        magic, version, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise ChunkError(f"bad magic {magic!r}")
        if version != VERSION:
            raise ChunkError(f"format version {version}, this build reads {VERSION}")
        if hlen > len(data) - _PREFIX.size - overhead:
            raise ChunkError(f"header length {hlen} runs past the chunk")
        view = memoryview(data)
        hend = _PREFIX.size + hlen
        if self._aead is not None:
            from cryptography.exceptions import InvalidTag
            nonce = bytes(view[hend:hend + NONCE_BYTES])
            try:
                payload = self._aead.decrypt(nonce, bytes(view[hend + NONCE_BYTES:]), key + bytes(view[:hend]))
            except InvalidTag:
                raise ChunkError("authentication failed (not encrypted under this secret for this key, "
                                 "or damaged)") from None
        else:
            if not hmac.compare_digest(self._mac(key, view[:-MAC_BYTES]), data[-MAC_BYTES:]):
                raise ChunkError("MAC mismatch (not written under this secret for this key, or damaged)")
            payload = view[hend:-MAC_BYTES]
        try:
            header = json.loads(bytes(view[_PREFIX.size:hend]))
        except ValueError as e:
            raise ChunkError(f"unreadable header: {e}") from None
        if not isinstance(header, dict):
            raise ChunkError(f"header is {type(header).__name__}, not an object")
        if header.get("key") != key.hex():
            raise ChunkError(f"chunk holds key {header.get('key')}, asked for {key.hex()}")
        want_enc = ENCRYPTED if self._aead is not None else "none"
        if header.get("enc") != want_enc:
            raise ChunkError(f"chunk encryption {header.get('enc')!r}, this store uses {want_enc!r}")
        got_shape = header.get("shape")
        want_dtype = str(dtype).removeprefix("torch.")
        if (not isinstance(got_shape, list) or tuple(got_shape) != tuple(shape)
                or header.get("dtype") != want_dtype):
            raise ChunkError(f"chunk is {got_shape} {header.get('dtype')}, the cache holds "
                             f"{list(shape)} {want_dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if len(payload) != numel * dtype.itemsize:
            raise ChunkError(f"payload of {len(payload)} bytes, expected {numel * dtype.itemsize}")
        t = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return t.view(dtype).view(shape)
