"""The stored chunk format: a round trip is bit-exact, and every damaged, truncated or foreign
chunk is refused with ChunkError (never returned as KV, never another exception)."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from kvserve.kvtier import ChunkCodec, ChunkError
from kvserve.kvtier import chunk as chunk_mod

KEY = hashlib.blake2b(b"some block", digest_size=16).digest()
OTHER_KEY = hashlib.blake2b(b"another block", digest_size=16).digest()
SHAPE = (2, 2, 4, 1, 3)  # [layers, k/v, block, kv heads, head dim], small
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODEC = ChunkCodec(b"0123456789abcdef-test-secret")


def _kv(dtype: torch.dtype, shape=SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    flat = t.view(-1)
    # Values a lossy path would change: signed zero, infinities, NaN, the smallest subnormal.
    specials = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    flat[:4] = specials
    flat[4] = torch.finfo(dtype).smallest_normal / 4
    return t


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _reseal(body: bytes) -> bytes:
    """``body`` with a correct MAC: a chunk whose damage only the other checks can see."""
    return body + CODEC._mac(KEY, body)


def _forge(header: dict | bytes, payload: bytes, magic: bytes = chunk_mod.MAGIC,
           version: int = chunk_mod.VERSION, hlen: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return _reseal(struct.pack("<4sHI", magic, version, len(h) if hlen is None else hlen) + h + payload)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [SHAPE, (30, 2, 16, 3, 64), (7,)], ids=["small", "smollm2-block", "flat"])
def test_round_trip_is_bit_exact(dtype, shape):
    kv = _kv(dtype, shape, seed=sum(shape))
    data = CODEC.encode(KEY, kv)
    assert isinstance(data, bytes)
    out = CODEC.decode(data, KEY, shape, dtype)
    assert out.dtype == dtype and tuple(out.shape) == tuple(shape)
    assert _bits(out) == _bits(kv)
    # The decoded tensor owns its memory: writing to it changes neither the input nor the bytes.
    out.view(-1)[0] = 1
    assert CODEC.decode(data, KEY, shape, dtype).view(-1)[0].isnan() == kv.view(-1)[0].isnan()
    assert _bits(CODEC.decode(data, KEY, shape, dtype)) == _bits(kv)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_of_a_non_contiguous_view(dtype):
    """The runner stores ``host[:, :, j]``: a strided slice of a bigger copy."""
    big = _kv(dtype, (2, 2, 3, 4, 1, 3), seed=7)
    view = big[:, :, 1]
    assert not view.is_contiguous()
    out = CODEC.decode(CODEC.encode(KEY, view), KEY, tuple(view.shape), dtype)
    assert _bits(out) == _bits(view)


def test_encoding_is_deterministic_and_self_describing():
    kv = _kv(torch.float16)
    a, b = CODEC.encode(KEY, kv), CODEC.encode(KEY, kv.clone())
    assert a == b
    assert a[:4] == b"KVSC"
    assert CODEC.encode(OTHER_KEY, kv) != a


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_flipped_byte_is_detected(dtype):
    kv = _kv(dtype)
    data = CODEC.encode(KEY, kv)
    for i in range(len(data)):  # header, payload and MAC alike
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(ChunkError):
                CODEC.decode(bytes(bad), KEY, SHAPE, dtype)


def test_every_truncation_is_detected():
    data = CODEC.encode(KEY, _kv(torch.float32))
    for n in range(len(data)):
        with pytest.raises(ChunkError):
            CODEC.decode(data[:n], KEY, SHAPE, torch.float32)


def test_appended_bytes_are_detected():
    data = CODEC.encode(KEY, _kv(torch.float32))
    for extra in (b"\x00", b"x" * 16, data[-16:]):
        with pytest.raises(ChunkError):
            CODEC.decode(data + extra, KEY, SHAPE, torch.float32)


def test_wrong_key_is_detected():
    data = CODEC.encode(KEY, _kv(torch.float32))
    with pytest.raises(ChunkError, match="key"):
        CODEC.decode(data, OTHER_KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("shape", [(2, 2, 4, 3, 1), (2, 2, 4, 1), (4, 2, 2, 1, 3), (2, 2, 4, 1, 3, 1), (48,)])
def test_wrong_shape_is_detected(shape):
    """Same number of elements or not: another cache layout must not be read as this one."""
    data = CODEC.encode(KEY, _kv(torch.float32))
    with pytest.raises(ChunkError):
        CODEC.decode(data, KEY, shape, torch.float32)


@pytest.mark.parametrize("stored,wanted", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                           (torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
def test_wrong_dtype_is_detected(stored, wanted):
    data = CODEC.encode(KEY, _kv(stored))
    with pytest.raises(ChunkError, match="float"):
        CODEC.decode(data, KEY, SHAPE, wanted)


def test_wrong_version_is_detected_even_with_a_valid_mac():
    data = CODEC.encode(KEY, _kv(torch.float32))
    body = data[:-chunk_mod.MAC_BYTES]
    for version in (0, chunk_mod.VERSION + 1, 0xFFFF):
        forged = _reseal(body[:4] + struct.pack("<H", version) + body[6:])
        with pytest.raises(ChunkError, match="version"):
            CODEC.decode(forged, KEY, SHAPE, torch.float32)


def test_wrong_magic_is_detected_even_with_a_valid_mac():
    data = CODEC.encode(KEY, _kv(torch.float32))
    body = data[:-chunk_mod.MAC_BYTES]
    for magic in (b"KVSD", b"\x00\x00\x00\x00", b"kvsc"):
        with pytest.raises(ChunkError, match="magic"):
            CODEC.decode(_reseal(magic + body[4:]), KEY, SHAPE, torch.float32)


def test_payload_length_is_checked_even_with_a_valid_mac():
    kv = _kv(torch.float32)
    payload = _bits(kv)
    header = {"key": KEY.hex(), "shape": list(SHAPE), "dtype": "float32", "enc": "none"}
    assert _bits(CODEC.decode(_forge(header, payload), KEY, SHAPE, torch.float32)) == payload
    for bad in (payload[:-4], payload[:-1], payload + b"\x00\x00\x00\x00", b""):
        with pytest.raises(ChunkError, match="payload"):
            CODEC.decode(_forge(header, bad), KEY, SHAPE, torch.float32)


def test_unreadable_header_is_detected_even_with_a_valid_mac():
    payload = _bits(_kv(torch.float32))
    header = json.dumps({"key": KEY.hex(), "shape": list(SHAPE), "dtype": "float32", "enc": "none"}).encode()
    cases = [
        _forge(b"{not json", payload),
        _forge(b"\xff\xfe\x00", payload),  # not UTF-8
        _forge(header, payload, hlen=len(header) - 1),  # header length cuts the JSON short
        _forge(header, payload, hlen=len(header) + 5),  # header length runs into the payload
        _forge(header, payload, hlen=2**32 - 1),
        _forge({"shape": list(SHAPE), "dtype": "float32", "enc": "none"}, payload),  # no key
        _forge({"key": KEY.hex(), "dtype": "float32", "enc": "none"}, payload),  # no shape
        _forge({"key": KEY.hex(), "shape": list(SHAPE)}, payload),  # no dtype
    ]
    for data in cases:
        with pytest.raises(ChunkError):
            CODEC.decode(data, KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("header", [b"null", b"[]", b"5", b'"key"',
                                    json.dumps({"key": KEY.hex(), "shape": 48, "dtype": "float32",
                                                "enc": "none"}).encode()],
                         ids=["null", "list", "number", "string", "shape-not-a-list"])
def test_header_of_the_wrong_json_type_is_a_chunk_error(header):
    """Not AttributeError or TypeError, which the store does not catch."""
    data = _forge(header, _bits(_kv(torch.float32)))
    with pytest.raises(ChunkError):
        CODEC.decode(data, KEY, SHAPE, torch.float32)


def test_random_garbage_is_detected():
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 10, 26, 100, 400, 4096):
        junk = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
        for data in (junk, b"KVSC" + junk, b"KVSC\x01\x00" + junk):
            with pytest.raises(ChunkError):
                CODEC.decode(data, KEY, SHAPE, torch.float32)


def test_unsupported_dtype_is_refused_at_encoding():
    with pytest.raises(ValueError):
        CODEC.encode(KEY, torch.zeros(SHAPE, dtype=torch.float64))


# -- authentication and encryption ---------------------------------------------------------------
ENCRYPTING = ChunkCodec(b"0123456789abcdef-test-secret", encrypt=True)


def test_valid_unkeyed_checksum_is_not_enough():
    """Zeroed KV sealed the way an unkeyed format would be (a public hash over the bytes, in the
    MAC's place) is refused: only the secret's holder can write a loadable chunk."""
    data = CODEC.encode(KEY, _kv(torch.float32))
    body = bytearray(data[:-chunk_mod.MAC_BYTES])
    hlen = struct.unpack_from("<4sHI", body)[2]
    start = struct.calcsize("<4sHI") + hlen
    body[start:] = bytes(len(body) - start)
    for tag in (hashlib.sha256(body).digest(), hashlib.blake2b(body, digest_size=32).digest(),
                hashlib.sha256(KEY + body).digest()):
        with pytest.raises(ChunkError, match="MAC"):
            CODEC.decode(bytes(body) + tag, KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("codec", [CODEC, ENCRYPTING], ids=["mac", "aes-gcm"])
def test_chunk_replayed_under_another_key_is_refused(codec):
    """A valid chunk stored under another key, its header rewritten to name that key, still
    fails: the MAC (or the GCM tag) covers the key it was written for."""
    data = codec.encode(KEY, _kv(torch.float32))
    replayed = data.replace(KEY.hex().encode(), OTHER_KEY.hex().encode())
    assert replayed != data and len(replayed) == len(data)
    for d in (data, replayed):
        with pytest.raises(ChunkError, match="MAC|authentication"):
            codec.decode(d, OTHER_KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aes-gcm"])
def test_another_secret_cannot_read_or_forge(encrypt):
    mine = ChunkCodec(b"0123456789abcdef-test-secret", encrypt)
    theirs = ChunkCodec(b"0123456789abcdef-test-secreT", encrypt)
    kv = _kv(torch.float32)
    with pytest.raises(ChunkError):
        mine.decode(theirs.encode(KEY, kv), KEY, SHAPE, torch.float32)
    with pytest.raises(ChunkError):
        theirs.decode(mine.encode(KEY, kv), KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_encrypted_round_trip_and_every_flipped_byte(dtype):
    kv = _kv(dtype)
    data = ENCRYPTING.encode(KEY, kv)
    assert _bits(ENCRYPTING.decode(data, KEY, SHAPE, dtype)) == _bits(kv)
    assert _bits(kv) not in data  # the payload is not stored as is
    assert ENCRYPTING.encode(KEY, kv) != data  # a fresh nonce per chunk
    for i in range(0, len(data), 3):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(ChunkError):
            ENCRYPTING.decode(bytes(bad), KEY, SHAPE, dtype)


def test_encryption_setting_must_match():
    """Plain chunks are not loaded by an encrypting store, nor encrypted ones by a plain store,
    under the same secret (dropped and rewritten in the store's own form)."""
    kv = _kv(torch.float32)
    with pytest.raises(ChunkError):
        ENCRYPTING.decode(CODEC.encode(KEY, kv), KEY, SHAPE, torch.float32)
    with pytest.raises(ChunkError):
        CODEC.decode(ENCRYPTING.encode(KEY, kv), KEY, SHAPE, torch.float32)


def test_short_secret_is_refused():
    with pytest.raises(ValueError):
        ChunkCodec(b"short")
