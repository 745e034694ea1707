"""The single-read safetensors reader against safetensors' own ``load_file`` and hashlib: random
non-zero tensors of mixed dtypes and odd sizes over several files, read in chunks so small that
tensors straddle them; a sink that copies late (as a device would) checks buffer reuse."""
from __future__ import annotations

import hashlib
import os
import threading

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from kvserve.errors import ModelLoadError
from kvserve.layers.linear import Linear
from kvserve.layers.weight_init import Embedding, loaded_later
from kvserve.models import shard_reader

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.uint8, torch.bool,
          torch.float64, torch.int32]


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        return torch.where(x == 0, 1.0, x).to(dtype)  # never zero
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=torch.int64)
    return torch.where(x == 0, 1, x).to(dtype)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three files of tensors (odd shapes, mixed dtypes, one empty) and the tensors themselves."""
    d = tmp_path_factory.mktemp("shards")
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 13), (1,), (3, 5, 7), (257,), (0, 4), (33, 3), (2, 1, 9), (61,), (5, 5), (129, 2)]
    files, tensors = [], {}
    for f in range(3):
        shard = {}
        for i, shape in enumerate(shapes[f::3] + [(11,)]):
            name = f"layers.{f}.t{i}"
            shard[name] = _random(shape, DTYPES[(3 * i + f) % len(DTYPES)], gen)
        path = str(d / f"model-{f:05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt"})
        files.append(path)
        tensors.update(shard)
    return files, tensors


def _dests(tensors) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Empty tensors like ``tensors`` filled with a marker, and their flat byte views."""
    out = {k: torch.full_like(v, 7) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in tensors.items()}
    return out, {k: v.view(-1).view(torch.uint8) for k, v in out.items()}


def _sha256(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


class LateCopySink(shard_reader.StagedSink):
    """Copies run only when the buffer is about to be refilled (or at finish), reading the
    buffer then, as a DMA engine would: a buffer refilled before its copies ran corrupts the
    result."""

    def __init__(self, dests, chunk_bytes: int, n: int = 2):
        super().__init__(dests, [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(n)])
        self.pending: list = [None] * n
        self.copies = 0

    def _wait(self, i: int) -> None:
        if self.pending[i] is not None:
            self._copies(i, self.pending[i])
            self.copies += len(self.pending[i].pieces)
            self.pending[i] = None

    def _issue(self, i: int, chunk) -> None:
        self.pending[i] = chunk

    def finish(self) -> None:
        for i in range(len(self.buffers)):
            self._wait(i)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
@pytest.mark.parametrize("sink_kind", ["direct", "staged", "late"])
def test_read_matches_safetensors_and_hashlib(shards, chunk_bytes, sink_kind):
    files, tensors = shards
    out, dests = _dests(tensors)
    make = {"direct": lambda: shard_reader.DirectSink(dests),
            "staged": lambda: shard_reader.StagedSink(dests, [torch.empty(chunk_bytes, dtype=torch.uint8)] * 1),
            "late": lambda: LateCopySink(dests, chunk_bytes)}[sink_kind]
    digests = {}
    for path in files:
        sink = make()
        digests[path] = shard_reader.read_file(path, shard_reader.read_header(path), sink, chunk_bytes)
        sink.finish()
    assert digests == {p: _sha256(p) for p in files}
    ref = {}
    for path in files:
        ref.update(load_file(path))
    assert ref.keys() == out.keys()
    for k, v in ref.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k], v), k


def test_staged_chunks_straddle_tensors(shards):
    """The case the sinks must handle: a chunk holding parts of several tensors, a tensor over
    several chunks; every tensor byte is in exactly one piece, and direct chunks never cross."""
    path = shards[0][0]
    header = shard_reader.read_header(path)
    staged = list(shard_reader.chunks(header, 100, split_at_tensors=False))
    assert any(len(c.pieces) > 1 for c in staged)
    assert any(sum(p.name == s.name for c in staged for p in c.pieces) > 1 for s in header.spans)
    for sink_split in (False, True):
        got = {}
        for c in shard_reader.chunks(header, 100, split_at_tensors=sink_split):
            assert c.nbytes <= 100 and sum(p.nbytes for p in c.pieces) <= c.nbytes
            if sink_split:
                assert len(c.pieces) <= 1 and all(p.nbytes == c.nbytes for p in c.pieces)
            for p in c.pieces:
                got[p.name] = got.get(p.name, 0) + p.nbytes
        assert got == {s.name: s.end - s.start for s in header.spans if s.end > s.start}


def test_parallel_files_each_sink_per_thread(shards):
    files, tensors = shards
    out, dests = _dests(tensors)
    made, seen = [], {}

    def make():
        made.append(threading.get_ident())
        return LateCopySink(dests, 64)

    jobs = [(p, shard_reader.read_header(p)) for p in files]
    shard_reader.read_files(jobs, make, 64, workers=3, on_range=lambda p, i, d: seen.__setitem__(p, (i, d)))
    assert seen == {p: (0, _sha256(p)) for p in files}
    assert len(made) == len(set(made))  # one sink per thread
    for path in files:
        for k, v in load_file(path).items():
            assert torch.equal(out[k], v)


@pytest.mark.parametrize("block_bytes, new_hash", [(1, hashlib.sha256), (97, xxhash.xxh3_128),
                                                   (4096, hashlib.sha256)])
@pytest.mark.parametrize("sink_kind", ["direct", "late"])
def test_ranges_hash_their_own_bytes_and_fill_every_tensor(shards, block_bytes, new_hash, sink_kind):
    """Files read in byte ranges shared by several threads (ranges inside the header, ranges
    cutting tensors): each range's digest is the hash library's own over those bytes, and
    every tensor is safetensors' own."""
    files, tensors = shards
    out, dests = _dests(tensors)
    seen = {}
    make = (lambda: shard_reader.DirectSink(dests)) if sink_kind == "direct" else (lambda: LateCopySink(dests, 64))
    jobs = [(p, shard_reader.read_header(p)) for p in files]
    shard_reader.read_files(jobs, make, 64, workers=4, block_bytes=block_bytes, new_hash=new_hash,
                            on_range=lambda p, i, d: seen.__setitem__((p, i), d))
    want = {}
    for p in files:
        data = open(p, "rb").read()
        want.update({(p, i // block_bytes): new_hash(data[i:i + block_bytes]).hexdigest()
                     for i in range(0, len(data), block_bytes)})
    assert seen == want
    for path in files:
        for k, v in load_file(path).items():
            assert torch.equal(out[k], v), k


def test_an_error_in_one_file_stops_the_others_and_finishes_every_sink(shards):
    files, tensors = shards
    _, dests = _dests(tensors)
    sinks = []

    def make():
        sinks.append(LateCopySink(dests, 16))
        return sinks[-1]

    def reject(path, block, digest):
        raise ModelLoadError(f"{path}: rejected")

    jobs = [(p, shard_reader.read_header(p)) for p in files]
    with pytest.raises(ModelLoadError, match="rejected"):
        shard_reader.read_files(jobs, make, 16, workers=2, on_range=reject, block_bytes=200)
    assert sinks and all(s.pending == [None, None] for s in sinks)  # finish ran: no copy left behind


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "header length -1"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length 1000000000"),
    (lambda b: b[:8] + b"[" + b[9:], "not JSON"),
    (lambda b: b[:8] + b[8:].replace(b'"F32"', b'"F99"'), "bad entry"),
    (lambda b: b[:8] + b[8:].replace(b'"data_offsets":[0,', b'"data_offsets":[4,'), "bytes at data offset 4"),
    (lambda b: b[:-4], "file size"),
])
def test_damaged_headers_are_refused(tmp_path, damage, message):
    good = str(tmp_path / "good.safetensors")
    save_file({"a": torch.ones(3, 4), "b": torch.ones(2)}, good)
    bad = _write(tmp_path / "bad.safetensors", damage(open(good, "rb").read()))
    with pytest.raises(ModelLoadError, match=f"bad.safetensors: corrupt or truncated safetensors file .*{message}"):
        shard_reader.read_header(bad)


def test_a_file_cut_after_its_header_was_read_is_refused(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.ones(1000)}, path)
    header = shard_reader.read_header(path)
    os.truncate(path, header.size - 100)
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors file .ends at byte"):
        shard_reader.read_file(path, header, shard_reader.DirectSink({"a": torch.empty(4000, dtype=torch.uint8)}), 512)


def test_layers_built_for_loaded_weights_skip_random_init(monkeypatch):
    calls = []
    for fn in ("kaiming_uniform_", "uniform_", "normal_"):
        monkeypatch.setattr(torch.nn.init, fn, lambda t, *a, _fn=fn, **k: calls.append(_fn) or t)
    with loaded_later():
        Linear(8, 8), Embedding(10, 4)
    assert calls == []
    Linear(8, 8), Embedding(10, 4)  # outside: initialised as torch does
    assert "kaiming_uniform_" in calls and "normal_" in calls
