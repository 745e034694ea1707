"""KV hand-over bandwidth of ``CudaIpcConnector`` against the device's copy ceiling, in one run.

Two processes, as in a disaggregated deployment of one host: the producer (a child process) holds
a KV pool of the model's real block shape (``KVCache``, ``--blocks`` blocks filled with random
values) and the consumer (this process) a pool of the same size and the store's staging memory
(``TieredStore``). Each transfer hands over all ``--blocks`` blocks (default: one 8,192-token
prompt) through the connector's own classes, exactly as the engines do:

    gather   producer: the blocks copied out of its pool (``data.movedim(2, 0)[ids]``, as
             kvserve/engine/kv_transfer.py does), queued on ``IpcProducer``
    write    producer's sender thread: ``SharedBuffer.write`` into the shared buffer (CUDA IPC
             device memory; a /dev/shm file on the CPU), then the slot's message over gloo
    read     consumer's receiver thread: ``SharedBuffer.read`` out of the buffer into host memory
             (pinned from a GPU), acknowledgement
    stage    the same thread: each block stored in the staging memory (``CpuTier.put``)
    load     consumer: ``TieredStore.take_run`` then ``TierConnector.load`` into its pool, as the
             decode engine does when the request is admitted (synchronised)

``handed over`` times gather to staged (the transfer id in ``Consumer.done``), ``end to end``
gather to loaded. ``one at a time``: ``--transfers`` transfers, each started once the previous
one was loaded (one burst prompt's latency; GB/s over the sum of their own times); ``streamed``:
as many queued at once as ``--kv-buffer-size`` holds (GB/s from the first gather to the last one
staged or loaded). ``--warmup`` streamed transfers come first (the staging memory allocates its
pinned slabs then). The stage columns are the seconds spent in each step (streamed: summed over
transfers that overlap); ``rest`` is what the steps leave of the hand-over (one at a time only:
messages, the consumer's copy of each block before ``put``, thread hand-offs).

Ceilings, measured in the consumer's process on the same number of bytes: ``device copy`` (one
tensor copied into another on the device; on the CPU a host memcpy); on CUDA also the host link
(device to pinned host and back). Every GB/s here counts the bytes handed over (payload), each
once: a copy of N bytes is N bytes, although the memory reads N and writes N. After the last
transfer the consumer's pool is compared with the producer's (an exact checksum).

    PYTHONPATH=$PWD python benchmarks/kv_transfer_bandwidth.py --blocks 8 --transfers 3     # CPU, tiny
    PYTHONPATH=$PWD python benchmarks/kv_transfer_bandwidth.py --device cuda --out DIR       # H200
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pool(args, device):
    """A KV pool of the model's real block shape, the layout both sides check, the block bytes."""
    import torch

    from kvserve.config import CacheConfig
    from kvserve.engine.kv_cache import KVCache
    from kvserve.models.loader import resolve
    arch = resolve(args.model).arch
    dtype = getattr(torch, args.dtype)
    block_size = args.block_size or CacheConfig().block_size
    cache = KVCache(arch, args.blocks, block_size, dtype, device)
    layout = {"kv_cache_dtype": "auto", "block_size": block_size, "block_shape": list(cache.block_shape),
              "dtype": str(dtype), "cache_key": args.model}
    return cache, layout, cache.data[:, :, 0].numel() * cache.data.element_size()


def _checksum(data) -> int:
    """Exact sum of the pool's 16-bit words (per layer: no large temporary)."""
    import torch
    words = data.view(torch.int16) if data.element_size() == 2 else data.view(torch.uint8)
    return int(sum(int(words[i].long().sum()) for i in range(words.shape[0])))


def _keys(i: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{i}:{j}".encode(), digest_size=16).digest() for j in range(n)]


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(obj, name: str, acc: dict) -> None:
    """Add the seconds each call of ``obj.name`` takes to ``acc[name]`` (the call itself is unchanged)."""
    inner = getattr(obj, name)

    def call(*a, **kw):
        t = time.monotonic()
        try:
            return inner(*a, **kw)
        finally:
            acc[name] = acc.get(name, 0.0) + time.monotonic() - t
    setattr(obj, name, call)


def _config(args, role: str, port: int):
    from kvserve.kv_transfer_config import KVTransferConfig
    return KVTransferConfig("CudaIpcConnector", role, kv_port=port, kv_buffer_size=args.kv_buffer_size)


def _producer(args, port: int, go, out) -> None:
    import torch

    from kvserve.kvtier.ipc import IpcProducer
    from kvserve.kvtier.transfer import Channel
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cache, layout, block_bytes = _pool(args, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in cache.data:  # (random values: a wrong byte shows in the checksum)
        layer.copy_(torch.randn(layer.shape, generator=gen, device=device, dtype=torch.float32))
    cfg = _config(args, "kv_producer", port)
    channel = Channel(cfg, torch.device("cpu"))
    channel.handshake(layout)
    producer = IpcProducer(channel, device, block_bytes, cfg.kv_buffer_size, cfg.extra("transfer_timeout_s"))
    acc: dict = {}
    _timed(producer.buffer, "write", acc)
    out.put(("ready", _checksum(cache.data)))
    data, ids = cache.data, torch.arange(args.blocks, device=device)
    nbytes = args.blocks * block_bytes
    while (i := go.get()) is not None:
        if i == "write":  # (seconds spent so far)
            out.put(("write", acc.get("write", 0.0)))
            continue
        while producer.queued_bytes + nbytes > producer.buffer_bytes:  # (streamed: as many as it queues)
            time.sleep(0.0002)
        t0 = time.monotonic()
        blocks = data.movedim(2, 0)[ids]
        tid = producer.send(_keys(i, args.blocks), blocks if device.type == "cuda" else blocks.cpu())
        out.put((i, tid, t0, time.monotonic() - t0))
    while producer.queued_bytes:
        time.sleep(0.001)
    out.put(("done", producer.dropped))
    out.close()
    out.join_thread()
    os._exit(0)  # (not waiting for the connector's threads, blocked in their channel)


def _copy_gbps(src, dst, reps: int) -> float:
    """Best of ``reps`` copies of ``src`` into ``dst`` (synchronised), in GB/s of bytes copied."""
    best = float("inf")
    for _ in range(reps + 1):  # (the first one warms up)
        _sync(src.device if src.is_cuda else dst.device)
        t = time.monotonic()
        dst.copy_(src)
        _sync(src.device if src.is_cuda else dst.device)
        best = min(best, time.monotonic() - t)
    return src.numel() * src.element_size() / best / 1e9


def ceilings(nbytes: int, device, reps: int = 5) -> dict:
    import torch
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.fill_(1)
    out = {"device_copy_gbps": _copy_gbps(a, b, reps)}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["device_to_host_gbps"] = _copy_gbps(a, host, reps)
        out["host_to_device_gbps"] = _copy_gbps(host, a, reps)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _run(args, pattern: str, first: int, n: int, go, out, consumer, conn, store, data, acc) -> dict:
    """``n`` transfers numbered from ``first``, one at a time or streamed."""
    rows, missing = [], 0
    go.put("write")
    start = dict(acc, write=out.get(timeout=600)[1])
    todo = [first] if pattern == "one at a time" else list(range(first, first + n))
    for i in todo:
        go.put(i)
    ids = list(range(args.blocks))
    for k in range(n):
        i, tid, t0, gather = out.get(timeout=600)
        assert i == first + k and tid is not None, f"transfer {i} was not sent"
        while tid not in consumer.done:
            if consumer.dead:
                raise RuntimeError("the KV transfer stopped")
            time.sleep(0.0001)
        t1 = time.monotonic()
        t = time.monotonic()
        run = store.take_run(_keys(i, args.blocks))
        missing += args.blocks - len(run)  # (staging memory full: the engine would compute those)
        if run:
            conn.load(data, [(ids[:len(run)], run)])  # (synchronises the device itself)
        _sync(data.device)
        t2 = time.monotonic()
        acc["load"] = acc.get("load", 0.0) + t2 - t
        acc["gather"] = acc.get("gather", 0.0) + gather
        rows.append((t0, t1, t2))
        if pattern == "one at a time" and k + 1 < n:
            go.put(first + k + 1)
    nbytes = args.blocks * args.block_bytes
    if pattern == "one at a time":  # (each transfer's own time: not the gaps between them)
        span = lambda j: sum(r[j] - r[0] for r in rows)  # noqa: E731
    else:  # (the first gather to the last one staged / loaded)
        span = lambda j: max(r[j] for r in rows) - min(r[0] for r in rows)  # noqa: E731
    res = {"transfers": n, "blocks_not_loaded": missing, "handed_over_gbps": n * nbytes / span(1) / 1e9,
           "end_to_end_gbps": n * nbytes / span(2) / 1e9,
           "handed_over_ms": [round((r[1] - r[0]) * 1e3, 3) for r in rows],
           "end_to_end_ms": [round((r[2] - r[0]) * 1e3, 3) for r in rows]}
    go.put("write")
    acc["write"] = out.get(timeout=600)[1]
    stage = {k: acc.get(k, 0.0) - start.get(k, 0.0) for k in ("gather", "write", "read", "put", "load")}
    if pattern == "one at a time":  # (serial: what the steps above leave of the hand-over's wall time)
        stage["rest"] = sum(r[1] - r[0] for r in rows) - sum(stage[k] for k in ("gather", "write", "read", "put"))
    res["stage_seconds"] = {k: round(v, 6) for k, v in stage.items()}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b", help="its KV shape (no weights are loaded)")
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the engine's)")
    p.add_argument("--blocks", type=int, default=512, help="blocks per transfer (512 x 16 tokens: an 8k prompt)")
    p.add_argument("--transfers", type=int, default=8, help="per pattern (one at a time, streamed)")
    p.add_argument("--warmup", type=int, default=4, help="transfers (streamed) before the timed ones")
    p.add_argument("--kv-buffer-size", default="4GiB", help="the shared buffer (kv_transfer_config.kv_buffer_size)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0: torch's default)")
    p.add_argument("--out", default=None, help="directory for kv_transfer_bandwidth.json")
    args = p.parse_args()
    import torch

    from kvserve.config import parse_size
    from kvserve.kvtier.connector import TierConnector
    from kvserve.kvtier.ipc import IpcConsumer
    from kvserve.kvtier.store import TieredStore
    from kvserve.kvtier.transfer import Channel
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.kv_buffer_size = parse_size(args.kv_buffer_size, "--kv-buffer-size")
    device = torch.device(args.device)
    cache, layout, args.block_bytes = _pool(args, device)
    nbytes = args.blocks * args.block_bytes
    if nbytes > args.kv_buffer_size:
        p.error(f"one transfer ({nbytes} bytes) does not fit --kv-buffer-size ({args.kv_buffer_size})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(args, port, go, out), daemon=True)
    proc.start()
    try:
        store = TieredStore(cache.block_shape, cache.data.dtype, device, block_size=layout["block_size"],
                            staging_bytes=args.kv_buffer_size)
        cfg = _config(args, "kv_consumer", port)
        channel = Channel(cfg, torch.device("cpu"))
        channel.handshake(layout)
        consumer = IpcConsumer(channel, store, cfg.extra("transfer_timeout_s"))
        acc: dict = {}
        _timed(consumer.buffer, "read", acc)
        _timed(store.staging, "put", acc)
        tag, want = out.get(timeout=600)
        assert tag == "ready"
        conn = TierConnector(store)
        res = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "block_shape": list(cache.block_shape), "block_bytes": args.block_bytes, "transfer_bytes": nbytes,
               "units": "GB/s = 1e9 bytes handed over (or copied) per second, each byte counted once"}
        n, w = args.transfers, max(1, args.warmup)  # (the warm-up allocates the staging's pinned slabs)
        _run(args, "streamed", 0, w, go, out, consumer, conn, store, cache.data, {})
        res["one_at_a_time"] = _run(args, "one at a time", w, n, go, out, consumer, conn, store, cache.data, acc)
        res["streamed"] = _run(args, "streamed", w + n, n, go, out, consumer, conn, store, cache.data, acc)
        consumer.dead = True  # (the producer's end closes the channel: expected now)
        go.put(None)
        res["dropped_transfers"] = out.get(timeout=600)[1]
        res["checksum_ok"] = _checksum(cache.data) == want
        res.update(ceilings(nbytes, device))
        for name in ("one_at_a_time", "streamed"):  # (the goal: the hand-over near the device copy)
            for k in ("handed_over", "end_to_end"):
                res[name][f"{k}_vs_device_copy"] = res[name][f"{k}_gbps"] / res["device_copy_gbps"]
    finally:
        go.put(None)
        proc.join(30)
    report(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_transfer_bandwidth.json"), "w") as f:
            json.dump(res, f, indent=1)


STAGES = ("gather", "write", "read", "put", "rest", "load")


def report(res: dict) -> None:
    ceil = res["device_copy_gbps"]
    mib = res["transfer_bytes"] / 2**20
    print(f"{res['device']}: {res['args']['model']} blocks {res['block_shape']} ({res['block_bytes']} bytes); "
          f"{res['args']['blocks']} blocks = {mib:.1f} MiB a transfer; {res['units']}")
    print("| pattern | handed over GB/s | % of device copy | end to end GB/s | % | handed over ms (median) "
          "| gather / write / read / put / rest / load s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in ("one_at_a_time", "streamed"):
        r = res[name]
        st = r["stage_seconds"]
        med = sorted(r["handed_over_ms"])[len(r["handed_over_ms"]) // 2]
        print(f"| {name.replace('_', ' ')} | {r['handed_over_gbps']:.2f} | {100 * r['handed_over_gbps'] / ceil:.1f} | "
              f"{r['end_to_end_gbps']:.2f} | {100 * r['end_to_end_gbps'] / ceil:.1f} | {med:.1f} | "
              f"{' / '.join(f'{st[k]:.3f}' if k in st else '-' for k in STAGES)} |")
    link = "".join(f", {k.removesuffix('_gbps').replace('_', ' ')} {res[k]:.2f}" for k in
                   ("device_to_host_gbps", "host_to_device_gbps") if k in res)
    missing = sum(res[k]["blocks_not_loaded"] for k in ("one_at_a_time", "streamed"))
    print(f"ceilings (GB/s): device copy {ceil:.2f}{link}; dropped transfers {res['dropped_transfers']}, "
          f"blocks not loaded {missing}; checksum {'ok' if res['checksum_ok'] else 'MISMATCH'}")


if __name__ == "__main__":
    main()
