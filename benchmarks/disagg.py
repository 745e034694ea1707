"""Decode latency while long prefills arrive: one combined instance against a prefill instance
plus a decode instance (``kv_transfer_config``, ``--connector``), in one run.

The workload (the same for both): ``--decodes`` short requests generating ``--decode-tokens``
tokens each start together; while they decode, ``--longs`` prompts of ``--long-tokens`` tokens
arrive every ``--long-gap`` seconds and generate ``--long-out`` tokens each.

    colocated  one engine runs everything (chunked prefill mixes the long prompts into the
               decodes' steps); on the CPU it gets ``--threads`` threads
    disagg     a prefill engine (another process) computes each long prompt with max_tokens=1 and
               sends its KV (TorchDistributedConnector: over gloo, NCCL on CUDA;
               CudaIpcConnector: through a buffer both processes map); the decode engine (this
               process) runs the short requests and continues each long one from the KV
               received; on the CPU each gets half the threads, so the two setups have the same
               cores

Per setup: the short requests' TTFT and inter-token latency (p50, p99, max), the long requests'
TTFT (arrival to first token), and wall time. Engines are driven step by step in-process (no
HTTP), timestamps taken when a step returns a request's new token. Prints a table; writes JSON
under --out. On one GPU the two processes share it with ``--connector CudaIpcConnector`` (NCCL
cannot pair two processes on one device); on two GPUs of one host either connector works
(``--prefill-device cuda:1``).

    PYTHONPATH=$PWD python benchmarks/disagg.py --model dummy:smollm2-135m --threads 2
    PYTHONPATH=$PWD python benchmarks/disagg.py --device cuda --connector CudaIpcConnector
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_kwargs(args, device: str) -> dict:
    return dict(kv_cache_memory=args.kv_cache_memory, show_progress=False, device=device,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.long_tokens + 256)


def prompts(args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    short = [[rng.randrange(1, vocab) for _ in range(args.decode_prompt)] for _ in range(args.decodes)]
    long = [[rng.randrange(1, vocab) for _ in range(args.long_tokens)] for _ in range(args.longs)]
    return short, long


def kv_config(args, role: str, port: int) -> dict:
    return {"kv_connector": args.connector, "kv_role": role, "kv_port": port, "kv_buffer_size": args.kv_buffer_size}


def _prefill_worker(args, port: int, threads: int, jobs, results) -> None:
    import torch

    from kvserve import LLM, SamplingParams
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(args.model, **engine_kwargs(args, args.prefill_device),
              kv_transfer_config=kv_config(args, "kv_producer", port))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    results.put("ready")
    eng = llm.engine
    pending = 0
    while True:
        while True:  # take every prompt that arrived, without waiting while some are prefilling
            try:
                job = jobs.get(timeout=None if pending == 0 else 0.0)
            except queue.Empty:
                break
            if job is None:
                return
            rid, ids = job
            eng.add_request(rid, {"prompt_token_ids": ids}, one)
            pending += 1
        for out in eng.step():
            if out.finished:
                pending -= 1
                results.put((out.request_id, out.kv_transfer_params))


class Recorder:
    """First-token and inter-token times of each request, from the outputs of each step."""

    def __init__(self):
        self.arrival: dict[str, float] = {}
        self.times: dict[str, list[float]] = {}
        self.seen: dict[str, int] = {}

    def observe(self, outs) -> None:
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > self.seen.get(o.request_id, 0):
                self.times.setdefault(o.request_id, []).extend([now] * (n - self.seen.get(o.request_id, 0)))
                self.seen[o.request_id] = n

    def stats(self, prefix: str) -> dict:
        ttft, itl = [], []
        for rid, ts in self.times.items():
            if not rid.startswith(prefix):
                continue
            ttft.append(ts[0] - self.arrival[rid])
            itl += [b - a for a, b in zip(ts, ts[1:])]
        pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None  # noqa: E731
        return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_max_ms": max(ttft) * 1e3 if ttft else None,
                "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
                "itl_max_ms": max(itl) * 1e3 if itl else None,
                "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else None}


def run_colocated(args) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_kwargs(args, args.device))
    eng, rec = llm.engine, Recorder()
    short, long = prompts(args, eng.arch.vocab_size)
    dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    lng = SamplingParams(max_tokens=args.long_out, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(short):
        rec.arrival[f"d{i}"] = time.perf_counter()
        eng.add_request(f"d{i}", {"prompt_token_ids": ids}, dec)
    nxt = 0
    while eng.has_unfinished_requests() or nxt < len(long):
        now = time.perf_counter()
        while nxt < len(long) and now - t0 >= args.long_start + nxt * args.long_gap:
            rec.arrival[f"l{nxt}"] = now
            eng.add_request(f"l{nxt}", {"prompt_token_ids": long[nxt]}, lng)
            nxt += 1
        rec.observe(eng.step())
    wall = time.perf_counter() - t0
    return {"decode": rec.stats("d"), "long": rec.stats("l"), "wall_s": wall}


def run_disagg(args) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    threads = max(1, args.threads // 2) if args.threads else 0
    if threads:
        torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_worker, args=(args, port, threads, jobs, results), daemon=True)
    proc.start()
    try:
        llm = LLM(args.model, **engine_kwargs(args, args.device),
                  kv_transfer_config=kv_config(args, "kv_consumer", port))
        assert results.get(timeout=600) == "ready"
        eng, rec = llm.engine, Recorder()
        short, long = prompts(args, eng.arch.vocab_size)
        dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        for i, ids in enumerate(short):
            rec.arrival[f"d{i}"] = time.perf_counter()
            eng.add_request(f"d{i}", {"prompt_token_ids": ids}, dec)
        sent = done = 0
        while eng.has_unfinished_requests() or done < len(long):
            now = time.perf_counter()
            while sent < len(long) and now - t0 >= args.long_start + sent * args.long_gap:
                rec.arrival[f"l{sent}"] = now
                jobs.put((f"l{sent}", long[sent]))
                sent += 1
            while not results.empty():
                rid, params = results.get()
                i = int(rid[1:])
                eng.add_request(rid, {"prompt_token_ids": long[i]},
                                SamplingParams(max_tokens=args.long_out, temperature=0, ignore_eos=True,
                                               kv_transfer_params=params))
                done += 1
            if eng.has_unfinished_requests():
                rec.observe(eng.step())
            else:
                time.sleep(0.001)
        wall = time.perf_counter() - t0
        loaded = eng.store.load_stats.tokens_loaded.get("remote", 0)
        return {"decode": rec.stats("d"), "long": rec.stats("l"), "wall_s": wall, "tokens_received": loaded}
    finally:
        jobs.put(None)
        proc.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prefill-device", default=None, help="the prefill instance's (default: --device)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the colocated engine (0: torch's "
                   "default); each disaggregated instance gets half")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--longs", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--long-out", type=int, default=4)
    p.add_argument("--long-start", type=float, default=0.5, help="seconds before the first long prompt")
    p.add_argument("--long-gap", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--only", choices=["colocated", "disagg"], default=None)
    p.add_argument("--connector", choices=["TorchDistributedConnector", "CudaIpcConnector"],
                   default="TorchDistributedConnector", help="the disaggregated setup's KV transport")
    p.add_argument("--kv-buffer-size", type=float, default=1e9, help="bytes of KV in flight (CudaIpcConnector: "
                   "its shared buffer, allocated beside the KV cache)")
    p.add_argument("--out", default=None, help="directory for disagg.json")
    args = p.parse_args()
    args.prefill_device = args.prefill_device or args.device
    res = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count()}
    for name, fn in (("colocated", run_colocated), ("disagg", run_disagg)):
        if args.only in (None, name):
            res[name] = fn(args)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print("| setup | decode TTFT p50 ms | ITL p50 ms | ITL p99 ms | ITL max ms | long TTFT p50 ms | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("colocated", "disagg"):
        if name in res:
            r = res[name]
            d, lg = r["decode"], r["long"]
            print(f"| {name} | {fmt(d['ttft_p50_ms'])} | {fmt(d['itl_p50_ms'])} | {fmt(d['itl_p99_ms'])} | "
                  f"{fmt(d['itl_max_ms'])} | {fmt(lg['ttft_p50_ms'])} | {r['wall_s']:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "disagg.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
