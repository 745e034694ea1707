"""Snapshots: a model in the engine's own layout, written once and loaded without conversion.

    DIR/
      kvserve_snapshot.json   manifest: format version, kvserve version, dtype, KV dtype, device,
                              the ModelArch, the source's fingerprint, each file's size and the
                              checksum (xxh3-128) of each of its 64 MiB blocks,
                              the CUDA profiling run's peak memory (so start-up can skip it)
      model-00000.safetensors the runner's parameters by their own names (fused qkv_proj and
      model-00001.safetensors gate_up_proj), in the dtype the engine runs; shards of <= 1 GiB
      tokenizer/             the tokenizer and its chat template (transformers' save_pretrained)

Loading reads every byte once (``shard_reader.py``): the headers first, checked against the
model (names, shapes, dtypes) before any data is read; then the blocks of every shard, handed
in order to one thread per core, each block hashed on the very bytes read. On the CPU a read
lands in the parameter's own storage; on CUDA in one of the thread's two pinned buffers, copied
to the device on the thread's own stream while the other buffer fills. A checksum mismatch fails
the load before the engine is returned.

The checksum finds damage (a changed, truncated or half-copied file); it is not a signature,
since whoever can change a file can change the manifest beside it. So it is XXH3-128 (the
``xxhash`` library), which hashes at memory speed, rather than sha256, which at about 1.3 GiB/s
a core was half of every loading thread's time. One digest per block rather than per file
because a file's digest is one thread's work, and a model in fewer shards than cores (or one
more) would load at the pace of its slowest shard.

A snapshot is refused, never silently converted, when its format version is not this one, when
a file's checksum or size does not match, when its tensors do not match the model its manifest
describes, when it was written for another device kind or CUDA architecture, or when a dtype
other than its own is asked for.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil

import torch
import xxhash

from kvserve.errors import ModelLoadError
from kvserve.layers.linear import dense_parameters
from kvserve.models import shard_reader
from kvserve.models.arch import ModelArch
from kvserve.progress import progress

FORMAT_VERSION = 2
MANIFEST = "kvserve_snapshot.json"
SHARD_BYTES = 1 << 30
HASH_BLOCK_BYTES = 64 << 20  # each file's checksum is taken per block of this many bytes
CHECKSUM = "xxh3_128"
# Loading: a read's size (on CUDA also each of a thread's two pinned buffers) and the most
# blocks read at once (each on its own thread, hashed by it).
LOAD_CHUNK_BYTES = 16 << 20
LOAD_THREADS = 16
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kvserve_version() -> str:
    """The installed kvserve's version (read from its metadata: the package root imports the
    engine, which this layer may not)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvserve")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH): the version line of its root
        root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py")
        with open(root) as f:
            found = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
        return found.group(1) if found else "unknown"


def is_snapshot(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def device_tag(device: torch.device) -> dict:
    """What a snapshot's weights were laid out for: the device kind and, on CUDA, its architecture."""
    if device.type != "cuda":
        return {"kind": device.type}
    major, minor = torch.cuda.get_device_capability(device)
    return {"kind": "cuda", "arch": f"sm_{major}{minor}", "name": torch.cuda.get_device_name(device)}


def _describe(tag: dict) -> str:
    return tag["kind"] + (f" {tag['arch']} ({tag.get('name', '?')})" if "arch" in tag else "")


def read_manifest(path: str) -> dict:
    """The manifest of the snapshot at ``path``, its format version checked."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{mpath}: not a readable snapshot manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION:
        got = m.get("format_version") if isinstance(m, dict) else None
        raise ModelLoadError(f"{path}: snapshot format version {got!r} (written by kvserve "
                             f"{m.get('kvserve_version', '?') if isinstance(m, dict) else '?'}); this kvserve "
                             f"{kvserve_version()} reads version {FORMAT_VERSION}: write it again with "
                             f"`kvserve snapshot MODEL --out DIR`")
    return m


def arch_of(manifest: dict, path: str) -> ModelArch:
    try:
        a = dict(manifest["arch"])
        a["eos_token_ids"] = tuple(a.get("eos_token_ids") or ())
        a["layer_windows"] = tuple(a.get("layer_windows") or ())
        return ModelArch(**a)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: the snapshot manifest's model description is invalid ({e})") from None


def check_compatible(manifest: dict, path: str, dtype: str, device: torch.device) -> None:
    """Refuse a snapshot written for another device or asked to run in another dtype."""
    want, have = manifest.get("device", {}), device_tag(device)
    if want.get("kind") != have["kind"] or want.get("arch") != have.get("arch"):
        raise ModelLoadError(f"{path}: this snapshot was written for {_describe(want)}; this device is "
                             f"{_describe(have)}: write one here with `kvserve snapshot MODEL --out DIR`")
    if dtype not in ("auto", manifest["dtype"]):
        raise ModelLoadError(f"{path}: this snapshot holds {manifest['dtype']} weights, dtype {dtype} was "
                             f"asked for: use dtype auto, or write a {dtype} snapshot "
                             f"(`kvserve snapshot MODEL --dtype {dtype}`)")


# -- writing ---------------------------------------------------------------------------------
def write(engine, out_dir: str) -> dict:
    """Write ``engine``'s model (an LLMEngine, weights loaded) as a snapshot; returns the manifest."""
    from safetensors.torch import save_file
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ModelLoadError(f"{out_dir}: exists and is not an empty directory; choose a new --out")
    rt = engine.runner
    if rt.tp is not None:
        raise ModelLoadError("a snapshot is written from one rank (tensor_parallel_size 1): this engine's "
                             "ranks each hold a slice of the weights")
    if any(n.endswith(".qweight") for n, _ in rt.model.named_buffers()):
        raise ModelLoadError("a snapshot holds float weights, and this model's are quantized; write it "
                             "from the model loaded with quantization none")
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in dense_parameters(rt.model):  # a tied weight is listed once
        n = p.numel() * p.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = p.detach()
        size += n
    names = [f"model-{i:05d}.safetensors" for i in range(len(shards))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        digests = []
        for fname, shard in zip(names, shards):
            save_file({k: v.contiguous().cpu() for k, v in shard.items()}, os.path.join(tmp, fname),
                      metadata={"format": "pt", "kvserve_snapshot": str(FORMAT_VERSION)})
            digests.append(pool.submit(_block_digests, os.path.join(tmp, fname)))  # beside the next write
        files = {f: {"blocks": d.result(), "bytes": os.path.getsize(os.path.join(tmp, f))}
                 for f, d in zip(names, digests)}
    if engine.tokenizer is not None:
        engine.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    manifest = {
        "format_version": FORMAT_VERSION,
        "kvserve_version": kvserve_version(),
        "dtype": DTYPE_NAMES[rt.dtype],
        "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
        "device": device_tag(rt.device),
        "arch": dataclasses.asdict(engine.arch),
        "source": {"name": engine.model_name, "fingerprint": rt.source_fingerprint},
        "checksum": CHECKSUM,
        "checksum_block_bytes": HASH_BLOCK_BYTES,
        "files": files,
        "tokenizer": engine.tokenizer is not None,
        # The CUDA profiling run's peak for these settings: start-up computes the KV pool from
        # it and today's free memory instead of running the forward again.
        "profile": rt.kv_profile,
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)
    os.rename(tmp, out_dir)  # a snapshot is complete or absent: the manifest never names a missing file
    return manifest


def _block_digests(path: str) -> list[str]:
    """The checksum of each HASH_BLOCK_BYTES block of the file."""
    out = []
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            out.append(xxhash.xxh3_128(block).hexdigest())
    return out or [xxhash.xxh3_128(b"").hexdigest()]


# -- loading ---------------------------------------------------------------------------------
def load_into(model: torch.nn.Module, path: str, manifest: dict, device: torch.device,
              show_progress: bool = False) -> None:
    """Read the snapshot's tensors into ``model``'s parameters (already on ``device``) and verify
    every file's checksum; raises ModelLoadError on any mismatch, before the model is used."""
    files = manifest.get("files") or {}
    params = dict(model.named_parameters())
    block_bytes = manifest.get("checksum_block_bytes")
    if type(block_bytes) is not int or block_bytes <= 0:
        raise ModelLoadError(f"{path}: the snapshot manifest's checksum_block_bytes is {block_bytes!r}, not a "
                             f"positive integer; write the snapshot again")
    try:
        for fname, entry in files.items():
            _check_size(path, fname, entry, block_bytes)
        headers = {os.path.join(path, f): shard_reader.read_header(os.path.join(path, f)) for f in files}
        _check_tensors(path, headers, params)
        # Each parameter's bytes, flat: a read or a copy lands in the parameter itself.
        dests = {name: p.detach().view(-1).view(torch.uint8) for name, p in params.items()}
        if device.type == "cuda":
            # The loading threads name the device by index (a new thread's current device is 0).
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            after = torch.cuda.current_stream(device)  # the parameters were allocated on it
            make_sink = lambda: _CudaSink(dests, device, after)  # noqa: E731
        else:
            make_sink = lambda: shard_reader.DirectSink(dests)  # noqa: E731
        bar = progress(show_progress, "Loading snapshot", "MiB", total=sum(e["bytes"] for e in files.values()) >> 20)

        def verify(fpath: str, block: int, digest: str | None) -> None:
            if digest is not None and digest != files[os.path.basename(fpath)]["blocks"][block]:
                lo = block * block_bytes
                raise ModelLoadError(f"{fpath}: checksum does not match the manifest (bytes {lo} to "
                                     f"{min(lo + block_bytes, os.path.getsize(fpath))}): the file changed or is "
                                     f"damaged; write the snapshot again")

        shard_reader.read_files(list(headers.items()), make_sink, LOAD_CHUNK_BYTES, load_threads(), verify,
                                block_bytes, None if bar is None else lambda n: bar.update(n / 2**20),
                                new_hash=xxhash.xxh3_128)
        if bar is not None:
            bar.close()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the snapshot ({e})") from None


def load_threads() -> int:
    """Shards read at once: one per core (each hashes its own shard), at most LOAD_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, LOAD_THREADS))


def _check_size(path: str, fname: str, entry: dict, block_bytes: int) -> None:
    fpath = os.path.join(path, fname)
    if not os.path.isfile(fpath):
        raise ModelLoadError(f"{fpath}: missing; the snapshot is incomplete, write it again")
    if not isinstance(entry, dict) or type(entry.get("bytes")) is not int:
        raise ModelLoadError(f"{fpath}: the manifest's entry {entry!r} has no integer size; write the snapshot again")
    if os.path.getsize(fpath) != entry.get("bytes"):
        raise ModelLoadError(f"{fpath}: {os.path.getsize(fpath)} bytes, the manifest says {entry.get('bytes')}: "
                             f"the file changed or is truncated; write the snapshot again")
    digests = entry.get("blocks")
    if not (isinstance(digests, list) and len(digests) == len(shard_reader.ranges(entry["bytes"], block_bytes))
            and all(isinstance(d, str) for d in digests)):
        raise ModelLoadError(f"{fpath}: the manifest's block checksums do not cover the file's "
                             f"{entry['bytes']} bytes in blocks of {block_bytes}; write the snapshot again")


def _check_tensors(path: str, headers: dict[str, shard_reader.Header], params: dict[str, torch.Tensor]) -> None:
    """Every tensor of the files is a parameter of the model, of its shape and dtype, once; every
    parameter is in the files."""
    seen: set[str] = set()
    for fpath, header in headers.items():
        for s in header.spans:
            dst = params.get(s.name)
            if dst is None or dst.shape != s.shape or dst.dtype != s.dtype or s.name in seen:
                want = ("no such parameter" if dst is None else "a second copy" if s.name in seen
                        else f"{tuple(dst.shape)} {dst.dtype}")
                raise ModelLoadError(f"{fpath}: tensor {s.name!r} ({s.shape} {s.dtype}) does not match the "
                                     f"model its manifest describes ({want})")
            seen.add(s.name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ModelLoadError(f"{path}: the snapshot lacks {len(missing)} parameters, e.g. {missing[:3]}")


class _CudaSink(shard_reader.StagedSink):
    """A loading thread's device copies: its chunks go through two pinned buffers, each copied
    to the parameters on the thread's own stream; an event after each buffer's copies lets the
    host refill it only once its bytes have left."""

    def __init__(self, dests: dict[str, torch.Tensor], device: torch.device, after: torch.cuda.Stream):
        torch.cuda.set_device(device)  # this thread's
        super().__init__(dests, [torch.empty(LOAD_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                                 for _ in range(2)])
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(after)
        self.events: list[torch.cuda.Event | None] = [None, None]

    def _wait(self, i: int) -> None:
        if self.events[i] is not None:
            self.events[i].synchronize()

    def _issue(self, i: int, chunk: shard_reader.Chunk) -> None:
        with torch.cuda.stream(self.stream):
            self._copies(i, chunk)
            self.events[i] = torch.cuda.Event(blocking=True)  # a waiting thread sleeps: the others hash
            self.events[i].record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()
