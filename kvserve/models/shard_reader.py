"""Safetensors shards read once: each byte comes off the disk a single time, lands in its
destination (or a staging buffer bound for the device) and is hashed on the way.

    file   [u64 LE header length N][N bytes of JSON][data ...................................]
                                                    ^ each tensor's data_offsets count from here
    data   |---- tensor a ----|-- b --|---------- tensor c ----------|
    staged [ chunk 0    ][ chunk 1    ][ chunk 2    ][ chunk 3    ][c4]   fixed windows: a chunk
            holds parts of several tensors, a tensor spans several chunks
    direct [ chunk 0     ][a][ b  ][ chunk 3    ][ chunk 4   ][ c5 ]   cut at tensor boundaries:
            each chunk is a slice of one tensor's own storage, read in place

A chunk's ``pieces`` say where its bytes go (tensor, offset in the tensor, offset in the chunk,
length). Bytes of no tensor (the header, any gap) are hashed and go nowhere. A file is read and
hashed as whole or in fixed byte ranges (``ranges``), each with its own digest: ranges of all the
files are the units the loading threads share, so a few large files keep every thread busy. The device part is
a sink (``DirectSink``, ``StagedSink`` and its CUDA subclass in ``snapshot.py``): this file
knows no device. The format is the safetensors project's
(https://github.com/huggingface/safetensors#format); writing stays with its library.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kvserve.errors import ModelLoadError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class Span:
    """One tensor's bytes: [start, end) in the file."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    raw: bytes  # the length and the JSON as read: the first bytes of the file's hash
    spans: tuple[Span, ...]  # by offset
    size: int  # of the whole file

    @property
    def data_start(self) -> int:
        return len(self.raw)


@dataclass(frozen=True)
class Piece:
    name: str
    tensor_offset: int
    chunk_offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    offset: int  # in the file
    nbytes: int
    pieces: tuple[Piece, ...]


def _corrupt(path: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: corrupt or truncated safetensors file ({why})")


def read_header(path: str) -> Header:
    """The file's tensors and where their bytes lie, every offset checked against the file."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise _corrupt(path, f"header length {n}, file size {size}")
        raw = head + f.read(n)
    try:
        meta = json.loads(raw[8:])
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(path, f"header is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise _corrupt(path, "header is not a JSON object")
    start, spans = len(raw), []
    for name, e in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            ok = all(type(d) is int and d >= 0 for d in (*shape, b, end)) and b <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(path, f"tensor {name!r}: bad entry {e!r}")
        if end - b != torch.Size(shape).numel() * dtype.itemsize or start + end > size:
            raise _corrupt(path, f"tensor {name!r}: {end - b} bytes at data offset {b} for {e['dtype']} "
                                 f"{list(shape)}, file size {size}")
        spans.append(Span(name, dtype, shape, start + b, start + end))
    spans.sort(key=lambda s: (s.start, s.end))
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise _corrupt(path, f"tensors {a.name!r} and {b.name!r} overlap")
    return Header(raw, tuple(spans), size)


def chunks(header: Header, chunk_bytes: int, split_at_tensors: bool, lo: int = 0,
           hi: int | None = None) -> Iterator[Chunk]:
    """The data region's bytes within [lo, hi) (default: the whole file) in reads of at most
    ``chunk_bytes``: fixed windows, or with ``split_at_tensors`` windows that never cross a
    tensor's first or last byte."""
    hi = header.size if hi is None else hi
    spans = [s for s in header.spans if s.end > s.start]
    cuts = {hi, *(x for s in spans for x in (s.start, s.end) if lo < x < hi)} if split_at_tensors else {hi}
    pos, first = max(lo, header.data_start), 0  # spans before ``first`` end at or before ``pos``
    for cut in sorted(cuts):
        while pos < cut:
            end = min(pos + chunk_bytes, cut)
            while first < len(spans) and spans[first].end <= pos:
                first += 1
            pieces = []
            for s in spans[first:]:
                if s.start >= end:
                    break
                lo_, hi_ = max(s.start, pos), min(s.end, end)
                pieces.append(Piece(s.name, lo_ - s.start, lo_ - pos, hi_ - lo_))
            yield Chunk(pos, end - pos, tuple(pieces))
            pos = end


def ranges(size: int, block_bytes: int) -> list[tuple[int, int]]:
    """A file of ``size`` bytes in consecutive [lo, hi) ranges of ``block_bytes`` (the last shorter)."""
    return [(lo, min(lo + block_bytes, size)) for lo in range(0, size, block_bytes)] or [(0, 0)]


class DirectSink:
    """Each chunk is read straight into the storage of the tensor it belongs to (CPU tensors):
    no staging buffer, no copy. ``dests``: name -> the tensor's bytes (flat uint8)."""
    split_at_tensors = True

    def __init__(self, dests: Mapping[str, torch.Tensor]):
        self.dests = dests
        self._views: dict[str, memoryview] = {}
        self._scratch = bytearray()

    def acquire(self, chunk: Chunk) -> memoryview:
        if len(chunk.pieces) != 1 or chunk.pieces[0].nbytes != chunk.nbytes:  # bytes of no tensor
            if len(self._scratch) < chunk.nbytes:
                self._scratch = bytearray(chunk.nbytes)
            return memoryview(self._scratch)[:chunk.nbytes]
        p = chunk.pieces[0]
        view = self._views.get(p.name)
        if view is None:
            view = self._views[p.name] = memoryview(self.dests[p.name].numpy())
        return view[p.tensor_offset:p.tensor_offset + p.nbytes]

    def release(self, chunk: Chunk, view: memoryview) -> None:
        pass

    def finish(self) -> None:
        pass


class StagedSink:
    """Chunks are read into host buffers taken in turn; each chunk's pieces are then copied to
    their tensors (``dests``: name -> flat uint8). Here the copies are done when ``copy_``
    returns; a device sink overrides ``_wait`` and ``_issue`` to copy asynchronously and to
    reuse a buffer only after its last copy has left."""
    split_at_tensors = False

    def __init__(self, dests: Mapping[str, torch.Tensor], buffers: list[torch.Tensor]):
        self.dests = dests
        self.buffers = buffers
        self._views = [memoryview(b.numpy()) for b in buffers]
        self.turn = 0

    def acquire(self, chunk: Chunk) -> memoryview:
        self._wait(self.turn)
        return self._views[self.turn][:chunk.nbytes]

    def release(self, chunk: Chunk, view: memoryview) -> None:
        self._issue(self.turn, chunk)
        self.turn = (self.turn + 1) % len(self.buffers)

    def _copies(self, i: int, chunk: Chunk) -> None:
        buf = self.buffers[i]
        for p in chunk.pieces:
            self.dests[p.name][p.tensor_offset:p.tensor_offset + p.nbytes].copy_(
                buf[p.chunk_offset:p.chunk_offset + p.nbytes], non_blocking=True)

    def _wait(self, i: int) -> None:
        pass

    def _issue(self, i: int, chunk: Chunk) -> None:
        self._copies(i, chunk)

    def finish(self) -> None:
        pass


def read_file(path: str, header: Header, sink, chunk_bytes: int, stop: threading.Event | None = None,
              on_bytes: Callable[[int], None] | None = None, new_hash: Callable = hashlib.sha256) -> str | None:
    """Read the file's data through ``sink`` and return the digest of the whole file (header
    included) by ``new_hash`` (a hashlib-style constructor); None when ``stop`` was set before
    the end."""
    return read_range(path, header, 0, header.size, sink, chunk_bytes, stop, on_bytes, new_hash)


def read_range(path: str, header: Header, lo: int, hi: int, sink, chunk_bytes: int,
               stop: threading.Event | None = None, on_bytes: Callable[[int], None] | None = None,
               new_hash: Callable = hashlib.sha256) -> str | None:
    """Read the file's bytes [lo, hi) through ``sink`` (those of the header are hashed from
    ``header.raw``) and return their digest; None when ``stop`` was set before the end."""
    h = new_hash(header.raw[lo:min(hi, header.data_start)])
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_SEQUENTIAL)  # deeper readahead on a cold read
        for chunk in chunks(header, chunk_bytes, sink.split_at_tensors, lo, hi):
            if stop is not None and stop.is_set():
                return None
            view = sink.acquire(chunk)
            got = 0
            while got < chunk.nbytes:  # preadv and the hashes release the GIL: ranges read in parallel
                n = os.preadv(fd, [view[got:]], chunk.offset + got)
                if n == 0:
                    raise _corrupt(path, f"ends at byte {chunk.offset + got}, its header says {header.size}")
                got += n
            h.update(view)
            sink.release(chunk, view)
            if on_bytes is not None:
                on_bytes(chunk.nbytes)
    return h.hexdigest()


def read_files(jobs: list[tuple[str, Header]], make_sink: Callable[[], object], chunk_bytes: int, workers: int,
               on_range: Callable[[str, int, str], None], block_bytes: int | None = None,
               on_bytes: Callable[[int], None] | None = None, new_hash: Callable = hashlib.sha256) -> None:
    """Read the files on ``workers`` threads, each with its own sink, in ranges of
    ``block_bytes`` (None: each file whole), handed out in file order to whichever thread is
    free; pass each range's digest (``new_hash``) to ``on_range(path, index, digest)`` as it
    completes. The first error (of a read, a sink or ``on_range``) stops every thread and is
    raised once all sinks have finished."""
    stop, local, sinks, lock = threading.Event(), threading.local(), [], threading.Lock()

    def one(path: str, header: Header, lo: int, hi: int) -> str | None:
        sink = getattr(local, "sink", None)
        if sink is None:
            sink = local.sink = make_sink()
            with lock:
                sinks.append(sink)
        return read_range(path, header, lo, hi, sink, chunk_bytes, stop, on_bytes, new_hash)

    work = [(path, header, i, lo, hi) for path, header in jobs
            for i, (lo, hi) in enumerate(ranges(header.size, block_bytes or max(header.size, 1)))]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(work))),
                                                 thread_name_prefix="kvserve-load")
    try:  # the executor's queue is first in, first out: ranges are taken in file order
        futures = {pool.submit(one, path, header, lo, hi): (path, i) for path, header, i, lo, hi in work}
        for fut in concurrent.futures.as_completed(futures):
            on_range(*futures[fut], fut.result())
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for sink in sinks:
            sink.finish()
