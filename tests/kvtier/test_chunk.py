"""The stored chunk format: a round trip is bit-exact, and every damaged, truncated or foreign
chunk is refused with ChunkError (never returned as KV, never another exception)."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from kvserve.kvtier import ChunkError, decode_chunk, encode_chunk
from kvserve.kvtier import chunk as chunk_mod

KEY = hashlib.blake2b(b"some block", digest_size=16).digest()
OTHER_KEY = hashlib.blake2b(b"another block", digest_size=16).digest()
SHAPE = (2, 2, 4, 1, 3)  # [layers, k/v, block, kv heads, head dim], small
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
    """``body`` with a correct checksum: a chunk whose damage only the other checks can see."""
    return body + hashlib.blake2b(body, digest_size=16).digest()


def _forge(header: dict | bytes, payload: bytes, magic: bytes = chunk_mod.MAGIC,
           version: int = chunk_mod.VERSION, hlen: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return _reseal(struct.pack("<4sHI", magic, version, len(h) if hlen is None else hlen) + h + payload)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [SHAPE, (30, 2, 16, 3, 64), (7,)], ids=["small", "smollm2-block", "flat"])
def test_round_trip_is_bit_exact(dtype, shape):
    kv = _kv(dtype, shape, seed=sum(shape))
    data = encode_chunk(KEY, kv)
    assert isinstance(data, bytes)
    out = decode_chunk(data, KEY, shape, dtype)
    assert out.dtype == dtype and tuple(out.shape) == tuple(shape)
    assert _bits(out) == _bits(kv)
    # The decoded tensor owns its memory: writing to it changes neither the input nor the bytes.
    out.view(-1)[0] = 1
    assert decode_chunk(data, KEY, shape, dtype).view(-1)[0].isnan() == kv.view(-1)[0].isnan()
    assert _bits(decode_chunk(data, KEY, shape, dtype)) == _bits(kv)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_of_a_non_contiguous_view(dtype):
    """The runner stores ``host[:, :, j]``: a strided slice of a bigger copy."""
    big = _kv(dtype, (2, 2, 3, 4, 1, 3), seed=7)
    view = big[:, :, 1]
    assert not view.is_contiguous()
    out = decode_chunk(encode_chunk(KEY, view), KEY, tuple(view.shape), dtype)
    assert _bits(out) == _bits(view)


def test_encoding_is_deterministic_and_self_describing():
    kv = _kv(torch.float16)
    a, b = encode_chunk(KEY, kv), encode_chunk(KEY, kv.clone())
    assert a == b
    assert a[:4] == b"KVSC"
    assert encode_chunk(OTHER_KEY, kv) != a


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_flipped_byte_is_detected(dtype):
    kv = _kv(dtype)
    data = encode_chunk(KEY, kv)
    for i in range(len(data)):  # header, payload and checksum alike
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(ChunkError):
                decode_chunk(bytes(bad), KEY, SHAPE, dtype)


def test_every_truncation_is_detected():
    data = encode_chunk(KEY, _kv(torch.float32))
    for n in range(len(data)):
        with pytest.raises(ChunkError):
            decode_chunk(data[:n], KEY, SHAPE, torch.float32)


def test_appended_bytes_are_detected():
    data = encode_chunk(KEY, _kv(torch.float32))
    for extra in (b"\x00", b"x" * 16, data[-16:]):
        with pytest.raises(ChunkError):
            decode_chunk(data + extra, KEY, SHAPE, torch.float32)


def test_wrong_key_is_detected():
    data = encode_chunk(KEY, _kv(torch.float32))
    with pytest.raises(ChunkError, match="key"):
        decode_chunk(data, OTHER_KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("shape", [(2, 2, 4, 3, 1), (2, 2, 4, 1), (4, 2, 2, 1, 3), (2, 2, 4, 1, 3, 1), (48,)])
def test_wrong_shape_is_detected(shape):
    """Same number of elements or not: another cache layout must not be read as this one."""
    data = encode_chunk(KEY, _kv(torch.float32))
    with pytest.raises(ChunkError):
        decode_chunk(data, KEY, shape, torch.float32)


@pytest.mark.parametrize("stored,wanted", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                           (torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
def test_wrong_dtype_is_detected(stored, wanted):
    data = encode_chunk(KEY, _kv(stored))
    with pytest.raises(ChunkError, match="float"):
        decode_chunk(data, KEY, SHAPE, wanted)


def test_wrong_version_is_detected_even_with_a_valid_checksum():
    data = encode_chunk(KEY, _kv(torch.float32))
    body = data[:-16]
    for version in (0, chunk_mod.VERSION + 1, 0xFFFF):
        forged = _reseal(body[:4] + struct.pack("<H", version) + body[6:])
        with pytest.raises(ChunkError, match="version"):
            decode_chunk(forged, KEY, SHAPE, torch.float32)


def test_wrong_magic_is_detected_even_with_a_valid_checksum():
    data = encode_chunk(KEY, _kv(torch.float32))
    body = data[:-16]
    for magic in (b"KVSD", b"\x00\x00\x00\x00", b"kvsc"):
        with pytest.raises(ChunkError, match="magic"):
            decode_chunk(_reseal(magic + body[4:]), KEY, SHAPE, torch.float32)


def test_payload_length_is_checked_even_with_a_valid_checksum():
    kv = _kv(torch.float32)
    payload = _bits(kv)
    header = {"key": KEY.hex(), "shape": list(SHAPE), "dtype": "float32"}
    assert _bits(decode_chunk(_forge(header, payload), KEY, SHAPE, torch.float32)) == payload
    for bad in (payload[:-4], payload[:-1], payload + b"\x00\x00\x00\x00", b""):
        with pytest.raises(ChunkError, match="payload"):
            decode_chunk(_forge(header, bad), KEY, SHAPE, torch.float32)


def test_unreadable_header_is_detected_even_with_a_valid_checksum():
    payload = _bits(_kv(torch.float32))
    header = json.dumps({"key": KEY.hex(), "shape": list(SHAPE), "dtype": "float32"}).encode()
    cases = [
        _forge(b"{not json", payload),
        _forge(b"\xff\xfe\x00", payload),  # not UTF-8
        _forge(header, payload, hlen=len(header) - 1),  # header length cuts the JSON short
        _forge(header, payload, hlen=len(header) + 5),  # header length runs into the payload
        _forge(header, payload, hlen=2**32 - 1),
        _forge({"shape": list(SHAPE), "dtype": "float32"}, payload),  # no key
        _forge({"key": KEY.hex(), "dtype": "float32"}, payload),  # no shape
        _forge({"key": KEY.hex(), "shape": list(SHAPE)}, payload),  # no dtype
    ]
    for data in cases:
        with pytest.raises(ChunkError):
            decode_chunk(data, KEY, SHAPE, torch.float32)


@pytest.mark.parametrize("header", [b"null", b"[]", b"5", b'"key"',
                                    json.dumps({"key": KEY.hex(), "shape": 48, "dtype": "float32"}).encode()],
                         ids=["null", "list", "number", "string", "shape-not-a-list"])
def test_header_of_the_wrong_json_type_is_a_chunk_error(header):
    """Not AttributeError or TypeError, which the store does not catch."""
    data = _forge(header, _bits(_kv(torch.float32)))
    with pytest.raises(ChunkError):
        decode_chunk(data, KEY, SHAPE, torch.float32)


def test_random_garbage_is_detected():
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 10, 26, 100, 400, 4096):
        junk = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
        for data in (junk, b"KVSC" + junk, b"KVSC\x01\x00" + junk):
            with pytest.raises(ChunkError):
                decode_chunk(data, KEY, SHAPE, torch.float32)


def test_unsupported_dtype_is_refused_at_encoding():
    with pytest.raises(ValueError):
        encode_chunk(KEY, torch.zeros(SHAPE, dtype=torch.float64))
