"""KV hand-over bandwidth of ``CudaIpcConnector`` against the device's copy ceiling, in one run.

Two processes, as in a disaggregated deployment of one host: the producer (a child process) holds
a KV pool of the model's real block shape (``KVCache`` allocated shareable, as a producer engine's
is, filled with random values) and the consumer (this process) a pool of its own with its
``BlockPool``. Each transfer hands over ``--blocks`` blocks (default: one 8,192-token prompt),
scattered over the producer's pool as a real prompt's are, through the connector's own classes:

    send     producer: ``IpcProducer.send`` holds the blocks and puts their numbers and keys
             into the message ring both processes map (no bytes move)
    land     consumer: ``IpcConsumer.land`` (what the decode engine runs before each step)
             takes the message, allocates blocks, copies them out of the producer's pool,
             mapped with CUDA IPC, into its own (kvserve/kernels/block_copy.py on a GPU) and
             registers them in the prefix cache
    release  producer: ``take_released`` reads the acknowledgement and frees the held blocks
             (not in the hand-over's time)

``handed over`` times the send call to the landed copy's completion (one clock: both processes
read the same monotonic clock); ``message`` is the part before the consumer saw the transfer,
``copy`` the landing itself, its copy synchronised. ``one at a time``: ``--transfers`` transfers,
each sent once the previous one landed (one burst prompt's latency; GB/s over the sum of their
own times); ``streamed``: all offered at once, the producer holding as many as
``--kv-buffer-size`` allows, the consumer landing each as it arrives without waiting for its copy
(as an engine does between steps; GB/s from the first send to the last copy complete, ``host in
land`` the consumer's time in the landing calls). ``--warmup`` transfers come first (the copy
kernel compiles then). The consumer polls for transfers without pause; an engine lands them
before its next step.

The ceiling, measured in the consumer's process on the same number of bytes: ``device copy`` (one
contiguous tensor copied into another on the device; on the CPU a host memcpy); on CUDA also the
host link (device to pinned host and back), which a transfer through host memory would be bound
by. Every GB/s counts the bytes handed over, each once: a copy of N bytes is N bytes, although the
memory reads N and writes N. After each pattern every landed transfer is compared with the
producer's blocks read through the mapping, and the mapping with the producer's own checksum of its
pool (exact checksums).

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
import random
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pool(args, device, num_blocks: int, alloc=None):
    """A KV pool of the model's real block shape, the layout both sides check, the block bytes."""
    import torch

    from kvserve.config import CacheConfig
    from kvserve.engine.kv_cache import KVCache
    from kvserve.models.loader import resolve
    arch = resolve(args.model).arch
    dtype = getattr(torch, args.dtype)
    block_size = args.block_size or CacheConfig().block_size
    cache = KVCache(arch, num_blocks, block_size, dtype, device, alloc=alloc)
    layout = {"kv_cache_dtype": "auto", "block_size": block_size, "block_shape": list(cache.block_shape),
              "dtype": str(dtype), "cache_key": args.model}
    return cache, layout, cache.data[:, :, 0].numel() * cache.data.element_size()


def _checksum(data, ids: list[int]) -> int:
    """Exact sum of these blocks' 16-bit words (per layer: no large temporary)."""
    import torch
    idx = torch.tensor(ids, device=data.device)
    words = data.view(torch.int16) if data.element_size() == 2 else data.view(torch.uint8)
    return int(sum(int(words[i][:, idx].long().sum()) for i in range(words.shape[0])))


def _keys(i: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{i}:{j}".encode(), digest_size=16).digest() for j in range(n)]


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(args, role: str, port: int):
    from kvserve.kv_transfer_config import KVTransferConfig
    return KVTransferConfig("CudaIpcConnector", role, kv_port=port, kv_buffer_size=args.kv_buffer_size)


def _producer(args, port: int, go, out) -> None:
    import torch

    from kvserve.kvtier.ipc import IpcProducer, shared_zeros
    from kvserve.kvtier.transfer import Channel
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shared = []

    def alloc(shape, dtype, dev):
        t, buf = shared_zeros(shape, dtype, dev)
        shared.append(buf)
        return t
    cache, layout, block_bytes = _pool(args, device, 2 * args.blocks, alloc)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in cache.data:  # (random values: a wrong byte shows in the checksum)
        layer.copy_(torch.randn(layer.shape, generator=gen, device=device, dtype=torch.float32))
    cfg = _config(args, "kv_producer", port)
    channel = Channel(cfg, torch.device("cpu"))
    channel.handshake(layout)
    producer = IpcProducer(channel, shared[0], tuple(cache.data.shape), cache.data.dtype, block_bytes,
                           cfg.kv_buffer_size)
    out.put(("ready", _checksum(cache.data, list(range(cache.data.shape[2])))))
    rng = random.Random(1)
    while (i := go.get()) is not None:
        ids = rng.sample(range(2 * args.blocks), args.blocks)  # (scattered, as a real prompt's blocks)
        keys = _keys(i, args.blocks)  # (an engine has them from the prefill: not timed)
        while True:  # (streamed: as many as kv_buffer_size lets it hold)
            producer.take_released()
            t0 = time.monotonic()
            if producer.send(str(i), keys, ids):
                break
            producer.dropped -= 1  # (waiting for room here, not dropping)
            time.sleep(0.00005)
        out.put((i, t0, ids))
    while producer.held:
        producer.take_released()
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


def _run(args, pattern: str, first: int, n: int, go, out, consumer, data) -> dict:
    """``n`` transfers numbered from ``first``, one at a time or streamed."""
    from kvserve.engine.block_pool import BlockPool
    bp = BlockPool(data.shape[2])
    host = None
    if pattern == "streamed":
        rows, landed, host = _streamed(first, n, go, out, consumer, bp, data)
        copy = None
    else:
        rows, landed, copy = [], [], 0.0
        go.put(first)
        for k in range(n):
            # The ring is watched at once: the producer's note of its send time comes through a
            # multiprocessing queue, later than its message does.
            tid = str(first + k)
            while not consumer.receive() and not consumer.inbox and tid not in consumer.done:
                if consumer.dead:  # (the message on its way)
                    raise RuntimeError("the KV transfer stopped")
            t1 = time.monotonic()
            while tid not in consumer.done:
                consumer.land(bp, data)
            _sync(data.device)
            t2 = time.monotonic()
            i, t0, src = out.get(timeout=600)
            assert i == first + k
            copy += t2 - t1
            rows.append((t0, t1, t2))
            landed.append((i, src))
            consumer.land(bp, data)  # (acknowledges: the copy is complete)
            if k + 1 < n:
                go.put(first + k + 1)
    bad = 0
    for i, src in landed:  # (the producer's blocks, read through the mapping, against the copies)
        dst = [bp.lookup(key) for key in _keys(i, args.blocks)]
        bad += None in dst or _checksum(data, dst) != _checksum(consumer.remote, src)
    nbytes = args.blocks * args.block_bytes
    if pattern == "one at a time":  # (each transfer's own time: not the gaps between them)
        span = sum(r[2] - r[0] for r in rows)
        message = sum(r[1] - r[0] for r in rows)
    else:  # (the first send to the last copy complete)
        span, message = max(r[2] for r in rows) - min(r[0] for r in rows), None
    return {"transfers": n, "transfers_wrong": bad, "handed_over_gbps": n * nbytes / span / 1e9,
            "handed_over_ms": [round((r[2] - r[0]) * 1e3, 3) for r in rows],
            "message_ms": [round((r[1] - r[0]) * 1e3, 3) for r in rows],
            "stage_seconds": {"message": None if message is None else round(message, 6),
                              "copy": None if copy is None else round(copy, 6),
                              "landing_host": None if host is None else round(host, 6)}}


def _streamed(first: int, n: int, go, out, consumer, bp, data) -> tuple[list, list, float]:
    """Every transfer offered at once (the producer holds what ``kv_buffer_size`` allows); the
    consumer lands each as it arrives, as an engine between its steps, without waiting for the
    copies (acknowledged as each completes): (send, seen, copy complete) times per transfer, the
    transfers, and the host's time in ``land``. A copy's completion is the time the poll saw it
    acknowledged."""
    for i in range(first, first + n):
        go.put(i)
    sent, seen, done, landed, host = {}, {}, {}, [], 0.0
    while len(done) < n:
        if consumer.dead:
            raise RuntimeError("the KV transfer stopped")
        while not out.empty():
            i, t0, src = out.get()
            sent[str(i)] = t0
            landed.append((i, src))
        consumer.receive()
        now = time.monotonic()
        for tid, *_ in consumer.inbox:
            seen.setdefault(tid, now)
        t = time.monotonic()
        consumer.land(bp, data)
        host += time.monotonic() - t
        acked = set(sent).intersection(consumer.done) - {tid for _, tid in consumer.unacked}
        for tid in acked:  # (acknowledged: its copy completed)
            done.setdefault(tid, time.monotonic())
        if len(done) < n:
            time.sleep(0.00005)
    _sync(data.device)
    rows = [(sent[t], seen.get(t, sent[t]), done[t]) for t in sorted(sent, key=int)]
    return rows, landed, host


def ipc_copy(remote, local, n: int, block_bytes: int, reps: int = 10) -> dict:
    """The data path alone: ``n`` scattered blocks copied out of the producer's pool (mapped here)
    into this process's, as ``land`` does; the median of ``reps`` after a warm-up, as wall time
    (the call, synchronised: what ``land`` pays, the block numbers' tensor built and sent to the
    device included) and on CUDA as device time (CUDA events around the kernel alone, its block
    numbers already on the device: events around the whole call would also count the host's work before
    the launch, while the device waits)."""
    import torch

    from kvserve.kvtier.ipc import copy_blocks
    rng = random.Random(2)
    sources, dests = rng.sample(range(remote.shape[2]), n), rng.sample(range(local.shape[2]), n)
    wall, dev = [], []
    for _ in range(reps + 1):
        _sync(local.device)
        t = time.perf_counter()
        copy_blocks(remote, local, sources, dests)
        _sync(local.device)
        wall.append(time.perf_counter() - t)
    if local.is_cuda:
        from kvserve.kernels.block_copy import copy_blocks as kernel
        on_device = torch.tensor([sources, dests], dtype=torch.int64, device=local.device)
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            kernel(remote, local, on_device)
            b.record()
            b.synchronize()
            dev.append(a.elapsed_time(b) / 1e3)
    med = sorted(wall[1:])[reps // 2]
    out = {"seconds": med, "gbps": n * block_bytes / med / 1e9}
    if dev:
        d = sorted(dev[1:])[reps // 2]
        out.update(device_seconds=d, device_gbps=n * block_bytes / d / 1e9)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b", help="its KV shape (no weights are loaded)")
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the engine's)")
    p.add_argument("--blocks", type=int, default=512, help="blocks per transfer (512 x 16 tokens: an 8k prompt)")
    p.add_argument("--transfers", type=int, default=8, help="per pattern (one at a time, streamed)")
    p.add_argument("--warmup", type=int, default=4, help="transfers (streamed) before the timed ones")
    p.add_argument("--kv-buffer-size", default="4GiB", help="bytes the producer holds for the consumer at most "
                   "(kv_transfer_config.kv_buffer_size)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0: torch's default)")
    p.add_argument("--out", default=None, help="directory for kv_transfer_bandwidth.json")
    args = p.parse_args()
    import torch

    from kvserve.config import parse_size
    from kvserve.kvtier.ipc import IpcConsumer
    from kvserve.kvtier.store import TieredStore
    from kvserve.kvtier.transfer import Channel
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.kv_buffer_size = parse_size(args.kv_buffer_size, "--kv-buffer-size")
    device = torch.device(args.device)
    _, _, args.block_bytes = _pool(args, device, 1)
    nbytes = args.blocks * args.block_bytes
    # Room for every transfer of a pattern: none is evicted before it is checked, after the pattern.
    cache, layout, _ = _pool(args, device, (max(args.transfers, args.warmup) + 1) * args.blocks)
    if nbytes > args.kv_buffer_size:
        p.error(f"one transfer ({nbytes} bytes) is more than --kv-buffer-size ({args.kv_buffer_size}) holds")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(args, port, go, out), daemon=True)
    proc.start()
    try:
        store = TieredStore(cache.block_shape, cache.data.dtype, device, block_size=layout["block_size"])
        cfg = _config(args, "kv_consumer", port)
        channel = Channel(cfg, torch.device("cpu"))
        channel.handshake(layout)
        consumer = IpcConsumer(channel, store, cfg.extra("transfer_timeout_s"), cache.data)
        tag, whole = out.get(timeout=600)
        assert tag == "ready"
        mapping_ok = _checksum(consumer.remote, list(range(consumer.remote.shape[2]))) == whole
        res = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "block_shape": list(cache.block_shape), "block_bytes": args.block_bytes, "transfer_bytes": nbytes,
               "units": "GB/s = 1e9 bytes handed over (or copied) per second, each byte counted once",
               "mapping_ok": mapping_ok}
        n, w = args.transfers, max(1, args.warmup)
        _run(args, "streamed", 0, w, go, out, consumer, cache.data)
        res["one_at_a_time"] = _run(args, "one at a time", w, n, go, out, consumer, cache.data)
        res["streamed"] = _run(args, "streamed", w + n, n, go, out, consumer, cache.data)
        res["ipc_copy"] = ipc_copy(consumer.remote, cache.data, args.blocks, args.block_bytes)
        go.put(None)
        res["dropped_transfers"] = out.get(timeout=600)[1]
        consumer.dead = True  # (the producer's end closes the channel: expected now)
        res.update(ceilings(nbytes, device))
        for r in (res["one_at_a_time"], res["streamed"], res["ipc_copy"]):  # (the goal: near the device copy)
            r["vs_device_copy"] = r.get("handed_over_gbps", r.get("gbps")) / res["device_copy_gbps"]
    finally:
        go.put(None)
        proc.join(30)
    for t in threading.enumerate():  # (the producer is gone: the receiver's channel fails, it ends)
        if t.name == "kv-transfer-recv":
            t.join(30)
    report(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_transfer_bandwidth.json"), "w") as f:
            json.dump(res, f, indent=1)


def report(res: dict) -> None:
    ceil = res["device_copy_gbps"]
    mib = res["transfer_bytes"] / 2**20
    print(f"{res['device']}: {res['args']['model']} blocks {res['block_shape']} ({res['block_bytes']} bytes); "
          f"{res['args']['blocks']} blocks = {mib:.1f} MiB a transfer; {res['units']}")
    print("| pattern | handed over GB/s | % of device copy | handed over ms (median) | message / copy s |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name in ("one_at_a_time", "streamed"):
        r = res[name]
        st = r["stage_seconds"]
        med = sorted(r["handed_over_ms"])[len(r["handed_over_ms"]) // 2]
        print(f"| {name.replace('_', ' ')} | {r['handed_over_gbps']:.2f} | {100 * r['handed_over_gbps'] / ceil:.1f} | "
              f"{med:.2f} | {' / '.join('-' if st.get(k) is None else f'{st[k]:.4f}' for k in ('message', 'copy'))}"
              f"{'' if st.get('landing_host') is None else ' (host in land {:.4f})'.format(st['landing_host'])} |")
    c = res["ipc_copy"]
    print(f"| the copy alone (scattered blocks, producer's pool -> this one's) | {c['gbps']:.2f} | "
          f"{100 * c['gbps'] / ceil:.1f} | {c['seconds'] * 1e3:.2f} | - |")
    if "device_gbps" in c:
        print(f"| the copy's kernel (CUDA events) | {c['device_gbps']:.2f} | {100 * c['device_gbps'] / ceil:.1f} | "
              f"{c['device_seconds'] * 1e3:.2f} | - |")
    link = "".join(f", {k.removesuffix('_gbps').replace('_', ' ')} {res[k]:.2f}" for k in
                   ("device_to_host_gbps", "host_to_device_gbps") if k in res)
    wrong = sum(res[k]["transfers_wrong"] for k in ("one_at_a_time", "streamed"))
    mapping = "the producer's" if res["mapping_ok"] else "DIFFERENT"
    print(f"ceilings (GB/s): device copy {ceil:.2f}{link}; dropped transfers {res['dropped_transfers']}; "
          f"transfers wrong {wrong}; bytes read through the mapping: {mapping}")


if __name__ == "__main__":
    main()
