"""Snapshots: a model in the engine's own layout, written once and loaded without conversion.

    DIR/
      kvserve_snapshot.json   manifest: format version, kvserve version, dtype, KV dtype, device,
                              the ModelArch, the source's fingerprint, each file's sha256 and size,
                              the CUDA profiling run's peak memory (so start-up can skip it)
      model-00000.safetensors the runner's parameters by their own names (fused qkv_proj and
      model-00001.safetensors gate_up_proj), in the dtype the engine runs; shards of <= 1 GiB
      tokenizer/             the tokenizer and its chat template (transformers' save_pretrained)

Loading memory-maps each shard (safetensors ``safe_open``) and copies every tensor into the
parameter of the same name: on CUDA through two pinned staging buffers whose copies to the
device run on a side stream, so reading the next tensor from the page cache overlaps the last
one's transfer. The checksums are verified at load, in threads beside the copies (hashlib
releases the GIL, so shards hash in parallel); a mismatch fails the load before the engine is
returned. sha256 because it is in the standard library everywhere kvserve runs and, hashed
shard by shard on several cores, keeps up with a disk read.

A snapshot is refused, never silently converted, when its format version is not this one, when
a file's checksum or size does not match, when its tensors do not match the model its manifest
describes, when it was written for another device kind or CUDA architecture, or when a dtype
other than its own is asked for.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil

import torch

from kvserve.errors import ModelLoadError
from kvserve.models.arch import ModelArch
from kvserve.progress import progress

FORMAT_VERSION = 1
MANIFEST = "kvserve_snapshot.json"
SHARD_BYTES = 1 << 30
STAGING_BYTES = 256 << 20  # each of the two pinned staging buffers
_READ_CHUNK = 16 << 20
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
    for name, p in rt.model.named_parameters():  # a tied weight is listed once
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
            digests.append(pool.submit(_sha256, os.path.join(tmp, fname)))  # beside the next shard's write
        files = {f: {"sha256": d.result(), "bytes": os.path.getsize(os.path.join(tmp, f))}
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
        "checksum": "sha256",
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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# -- loading ---------------------------------------------------------------------------------
def load_into(model: torch.nn.Module, path: str, manifest: dict, device: torch.device,
              show_progress: bool = False) -> None:
    """Copy the snapshot's tensors into ``model``'s parameters (already on ``device``) and verify
    every file's checksum; raises ModelLoadError on any mismatch."""
    from safetensors import SafetensorError, safe_open
    files = manifest.get("files") or {}
    params = dict(model.named_parameters())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, len(files))),
                                                 thread_name_prefix="kvserve-verify")
    try:
        digests = {f: pool.submit(_sha256, os.path.join(path, f)) for f in files if _check_size(path, f, files[f])}
        seen: set[str] = set()
        stager = _Stager(device) if device.type == "cuda" else None
        bar = progress(show_progress, "Loading snapshot", "tensor", total=len(params))
        for fname in files:
            fpath = os.path.join(path, fname)
            try:
                with safe_open(fpath, framework="pt") as f:
                    for name in f.keys():
                        dst = params.get(name)
                        src = f.get_tensor(name)
                        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
                            want = "no such parameter" if dst is None else f"{tuple(dst.shape)} {dst.dtype}"
                            raise ModelLoadError(f"{fpath}: tensor {name!r} ({tuple(src.shape)} {src.dtype}) does "
                                                 f"not match the model its manifest describes ({want})")
                        with torch.no_grad():
                            if stager is None:
                                dst.data.copy_(src)
                            else:
                                stager.copy(src, dst.data)
                        seen.add(name)
                        if bar is not None:
                            bar.update(1)
            except SafetensorError as e:
                raise ModelLoadError(f"{fpath}: corrupt or truncated safetensors file ({e})") from None
        if stager is not None:
            stager.finish()
        if bar is not None:
            bar.close()
        missing = sorted(set(params) - seen)
        if missing:
            raise ModelLoadError(f"{path}: the snapshot lacks {len(missing)} parameters, e.g. {missing[:3]}")
        for fname, fut in digests.items():
            if fut.result() != files[fname]["sha256"]:
                raise ModelLoadError(f"{os.path.join(path, fname)}: sha256 does not match the manifest: the "
                                     f"file changed or is damaged; write the snapshot again")
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the snapshot ({e})") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_size(path: str, fname: str, entry: dict) -> bool:
    fpath = os.path.join(path, fname)
    if not os.path.isfile(fpath):
        raise ModelLoadError(f"{fpath}: missing; the snapshot is incomplete, write it again")
    if os.path.getsize(fpath) != entry.get("bytes"):
        raise ModelLoadError(f"{fpath}: {os.path.getsize(fpath)} bytes, the manifest says {entry.get('bytes')}: "
                             f"the file changed or is truncated; write the snapshot again")
    return True


class _Stager:
    """Host -> device copies through two pinned buffers: while one buffer's bytes travel on the
    copy stream, the host fills the other from the memory map (a plain CPU tensor cannot be
    copied asynchronously; a pinned one can)."""

    def __init__(self, device: torch.device, nbytes: int = STAGING_BYTES):
        self.device = device
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.done = [None, None]  # the event after each buffer's last copy
        self.stream = torch.cuda.Stream(device)
        # The parameters were allocated (and filled) on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.turn = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        s = src.contiguous().view(-1).view(torch.uint8)
        d = dst.view(-1).view(torch.uint8)
        n, cap = s.numel(), self.bufs[0].numel()
        for off in range(0, n, cap):
            k = min(cap, n - off)
            buf, ev = self.bufs[self.turn], self.done[self.turn]
            if ev is not None:
                ev.synchronize()  # the buffer's previous bytes have left
            buf[:k].copy_(s[off:off + k])
            with torch.cuda.stream(self.stream):
                d[off:off + k].copy_(buf[:k], non_blocking=True)
                ev = self.done[self.turn] = torch.cuda.Event()
                ev.record(self.stream)
            self.turn ^= 1

    def finish(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
