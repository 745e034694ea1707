"""Decode latency while long prefills arrive: the decodes alone, one combined instance, and a
prefill instance plus a decode instance (``kv_transfer_config``, ``--connector``), in one run.

The workload: ``--decodes`` chat-like requests (``--decode-prompt`` prompt tokens, generating
``--decode-tokens`` each) start together; while they decode, ``--longs`` prompts of
``--long-tokens`` tokens arrive ``--burst`` at a time, a burst every ``--long-gap`` seconds from
``--long-start`` on, and generate ``--long-out`` tokens each. Setups, in this order, each in a
process of its own (so the previous one's engines have given their memory back):

    baseline   one engine, the same decodes and no long prompts: what the decodes' latency is
               without the bursts
    colocated  one engine runs everything (chunked prefill mixes the long prompts into the
               decodes' steps); on the CPU it gets ``--threads`` threads, as does the baseline
    disagg     a prefill engine (another process) computes each long prompt with max_tokens=1 and
               sends its KV (TorchDistributedConnector: over gloo, NCCL on CUDA;
               CudaIpcConnector: through a buffer both processes map); the decode engine runs
               the short requests and continues each long one from the KV received; on the CPU
               each gets half the threads, so the two loaded setups have the same cores

Every engine is first warmed with one short and one long prompt of other tokens (kernels compile
for these shapes before any timing). Per setup: the short requests' TTFT, inter-token latency
(p50, p99, max) and output tokens per second (first arrival to last token), the long requests'
TTFT (arrival to first token), wall time; and the colocated and disaggregated setups' decode ITL
p50/p99 and tokens per second over the baseline's (``ratios``). Engines are driven step by step
(no HTTP), timestamps taken when a step returns a request's new token. Prints a table; writes JSON
under --out after each setup. Options left unset take the device's defaults (``DEFAULTS``).

On one GPU the two processes share it with ``--connector CudaIpcConnector`` (the default there:
NCCL cannot pair two processes on one device), the memory split by ``--kv-cache-memory`` per
engine; on two GPUs of one host either connector works (``--prefill-device cuda:1``). Two
processes on one GPU take turns on it (time slices) unless CUDA MPS runs them side by side:
``--prefill-sm-percent`` then caps the prefill process's share of the SMs, and
``--prefill-priority below_normal`` has MPS give the decode process's kernels the SMs first.

One H200 (141 GB), Llama-3-8B shape (bf16: 15 GiB of weights per engine, 128 KiB of KV a token,
1 GiB per 8k prompt): 24 GiB of KV cache per engine holds 196k tokens (the decode engine needs
about 100k: 32 x 1,024 plus 8 x 8,208); ``--kv-buffer-size`` 4 GiB lets the prefill engine hold
four 8k prompts for the decode engine (in its own cache); in all about 80 GB of the GPU. With the transfer
bandwidth (benchmarks/kv_transfer_bandwidth.py), in one command:

    PYTHONPATH=$PWD timeout 150 python benchmarks/kv_transfer_bandwidth.py --device cuda --out $OUT; \
    PYTHONPATH=$PWD timeout 420 python benchmarks/disagg.py --model dummy:llama-3-8b --device cuda \
        --connector CudaIpcConnector --decodes 32 --decode-prompt 512 --decode-tokens 512 --longs 8 \
        --burst 2 --long-tokens 8192 --long-out 16 --long-start 0.5 --long-gap 0.75 \
        --max-num-batched-tokens 2048 --kv-cache-memory 24GiB --kv-buffer-size 4GiB --out $OUT

On the CPU (seconds; ``--threads 1`` on a shared box, where two threads wait on each other):

    PYTHONPATH=$PWD python benchmarks/disagg.py --model dummy:smollm2-135m --threads 1 --decodes 4 \
        --decode-tokens 64 --longs 4 --burst 2 --long-tokens 256 --long-start 0.3 --long-gap 0.8 \
        --max-num-batched-tokens 128 --connector CudaIpcConnector --kv-buffer-size 64MiB
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


def prompts(args, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    short = [[rng.randrange(1, vocab) for _ in range(args.decode_prompt)] for _ in range(args.decodes)]
    long = [[rng.randrange(1, vocab) for _ in range(args.long_tokens)] for _ in range(args.longs)]
    return short, long


def warm_up(llm, args) -> None:
    """One short and one long prompt of other tokens, before any timing: kernels compile for
    these shapes (a producer also sends the long one, which warms the transfer path)."""
    from kvserve import SamplingParams
    short, long = prompts(args, llm.engine.arch.vocab_size, seed=1)
    batch = [{"prompt_token_ids": short[0]}] + ([{"prompt_token_ids": long[0]}] if long else [])
    llm.generate(batch, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)


def arrivals(args) -> list[float]:
    """Seconds after the start at which each long prompt arrives: ``--burst`` at a time."""
    return [args.long_start + (i // args.burst) * args.long_gap for i in range(args.longs)]


def kv_config(args, role: str, port: int) -> dict:
    return {"kv_connector": args.connector, "kv_role": role, "kv_port": port, "kv_buffer_size": args.kv_buffer_size}


def _prefill_worker(args, port: int, threads: int, jobs, results) -> None:
    if args.prefill_sm_percent:  # (read when this process's CUDA context starts: before any CUDA call)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.prefill_sm_percent)
    if args.prefill_priority == "below_normal":  # (likewise; MPS schedules the decode process's work first)
        os.environ["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    import torch

    from kvserve import LLM, SamplingParams
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(args.model, **engine_kwargs(args, args.prefill_device),
              kv_transfer_config=kv_config(args, "kv_producer", port))
    warm_up(llm, args)
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
            if job is None:  # (every transfer was loaded: the decode engine finished their requests)
                results.close()
                results.join_thread()
                os._exit(0)  # (not waiting for the connector's threads, blocked in their channel)
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
        """TTFT, ITL and output tokens per second (first arrival to last token) of these requests."""
        ttft, itl, ends = [], [], []
        for rid, ts in self.times.items():
            if not rid.startswith(prefix):
                continue
            ttft.append(ts[0] - self.arrival[rid])
            itl += [b - a for a, b in zip(ts, ts[1:])]
            ends.append(ts[-1])
        pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None  # noqa: E731
        tokens = sum(len(ts) for rid, ts in self.times.items() if rid.startswith(prefix))
        first = min((t for rid, t in self.arrival.items() if rid.startswith(prefix)), default=None)
        return {"requests": len(ttft), "tokens": tokens, "itl_samples": len(itl),
                "ttft_p50_ms": pct(ttft, 0.5), "ttft_max_ms": max(ttft) * 1e3 if ttft else None,
                "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
                "itl_max_ms": max(itl) * 1e3 if itl else None,
                "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else None,
                "tokens_per_s": tokens / (max(ends) - first) if ends else None}


def run_colocated(args, longs: bool = True) -> dict:
    """One engine; ``longs`` false: the baseline, the same decodes and no long prompts."""
    import torch

    from kvserve import LLM, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_kwargs(args, args.device))
    warm_up(llm, args)
    eng, rec = llm.engine, Recorder()
    short, long = prompts(args, eng.arch.vocab_size)
    long, due = (long, arrivals(args)) if longs else ([], [])
    dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    lng = SamplingParams(max_tokens=args.long_out, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(short):
        rec.arrival[f"d{i}"] = time.perf_counter()
        eng.add_request(f"d{i}", {"prompt_token_ids": ids}, dec)
    nxt = 0
    while eng.has_unfinished_requests() or nxt < len(long):
        now = time.perf_counter()
        while nxt < len(long) and now - t0 >= due[nxt]:
            rec.arrival[f"l{nxt}"] = now
            eng.add_request(f"l{nxt}", {"prompt_token_ids": long[nxt]}, lng)
            nxt += 1
        rec.observe(eng.step())
    wall = time.perf_counter() - t0
    return {"decode": rec.stats("d"), "long": rec.stats("l"), "wall_s": wall}


def run_baseline(args) -> dict:
    return run_colocated(args, longs=False)


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
        warm_up(llm, args)
        assert results.get(timeout=900) == "ready"
        eng, rec = llm.engine, Recorder()
        short, long = prompts(args, eng.arch.vocab_size)
        due = arrivals(args)
        dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        for i, ids in enumerate(short):
            rec.arrival[f"d{i}"] = time.perf_counter()
            eng.add_request(f"d{i}", {"prompt_token_ids": ids}, dec)
        sent = done = reused = 0
        while eng.has_unfinished_requests() or done < len(long):
            now = time.perf_counter()
            while sent < len(long) and now - t0 >= due[sent]:
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
                outs = eng.step()
                rec.observe(outs)
                # The prompt tokens the decode engine did not compute: the prefill engine's blocks,
                # loaded from staging (gloo) or landed in the prefix cache (CUDA IPC).
                reused += sum(o.num_cached_tokens for o in outs if o.finished and o.request_id[0] == "l")
            else:
                time.sleep(0.001)
        wall = time.perf_counter() - t0
        eng.kv_transfer.consumer.dead = True  # (the prefill engine's end closes the channel: expected now)
        return {"decode": rec.stats("d"), "long": rec.stats("l"), "wall_s": wall, "tokens_received": reused,
                "tokens_handed_over": sum(len(x) // eng.block_size * eng.block_size for x in long)}
    finally:
        jobs.put(None)
        proc.join(30)


SETUPS = {"baseline": run_baseline, "colocated": run_colocated, "disagg": run_disagg}


def _setup_process(name: str, args, results) -> None:
    try:
        results.put((name, SETUPS[name](args)))
    except BaseException as e:
        results.put((name, {"error": f"{type(e).__name__}: {e}"[:2000]}))
        raise


def run_isolated(name: str, args) -> dict:
    """Each setup in a process of its own: the previous one's engines have given their memory back."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_setup_process, args=(name, args, results))  # (not a daemon: it may start one)
    proc.start()
    while True:
        try:
            got = results.get(timeout=1.0)
            break
        except queue.Empty:
            if not proc.is_alive():
                got = (name, {"error": f"the {name} process ended with code {proc.exitcode}"})
                break
    proc.join(60)
    return got[1]


# What the options left unset take: a CPU run of seconds, or one H200 holding both engines
# (Llama-3-8B, bf16: 15 GiB of weights each; 128 KiB of KV a token, 1 GiB per 8k prompt).
DEFAULTS = {"cpu": {"long_tokens": 1024, "max_num_batched_tokens": 512, "kv_cache_memory": "256MiB",
                    "kv_buffer_size": "1GiB"},
            "cuda": {"long_tokens": 8192, "max_num_batched_tokens": 2048, "kv_cache_memory": "24GiB",
                     "kv_buffer_size": "4GiB"}}


def ratios(res: dict) -> dict:
    """Each loaded setup's decode p50/p99 ITL and throughput over the baseline's."""
    base = res.get("baseline", {}).get("decode")
    out = {}
    for name in ("colocated", "disagg"):
        d = res.get(name, {}).get("decode")
        if base and d:
            for key in ("itl_p50_ms", "itl_p99_ms", "tokens_per_s"):
                if base.get(key) and d.get(key) is not None:
                    out[f"{name}_{key.removesuffix('_ms')}_vs_baseline"] = d[key] / base[key]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--prefill-device", default=None, help="the prefill instance's (default: --device)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the colocated engine (0: torch's "
                   "default); each disaggregated instance gets half")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--longs", type=int, default=3)
    p.add_argument("--burst", type=int, default=1, help="long prompts arriving together")
    p.add_argument("--long-tokens", type=int, default=None, help="cpu 1024, cuda 8192")
    p.add_argument("--long-out", type=int, default=4)
    p.add_argument("--long-start", type=float, default=0.5, help="seconds before the first long prompts")
    p.add_argument("--long-gap", type=float, default=1.0, help="seconds between bursts")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="cpu 512, cuda 2048")
    p.add_argument("--kv-cache-memory", default=None, help="per engine: cpu 256MiB, cuda 24GiB")
    p.add_argument("--only", choices=list(SETUPS), default=None)
    p.add_argument("--connector", choices=["TorchDistributedConnector", "CudaIpcConnector"], default=None,
                   help="the disaggregated setup's KV transport (default: CudaIpcConnector when both engines "
                   "share one GPU, else TorchDistributedConnector)")
    p.add_argument("--kv-buffer-size", default=None, help="bytes of KV in flight, cpu 1GiB, cuda 4GiB "
                   "(CudaIpcConnector: the prefill engine's blocks held until the decode engine copied them)")
    p.add_argument("--prefill-sm-percent", type=int, default=None, help="under CUDA MPS (a running "
                   "nvidia-cuda-mps-control daemon): the share of the GPU's SMs the prefill process may use, "
                   "so that the decode process's kernels run beside its prefills instead of taking turns")
    p.add_argument("--prefill-priority", choices=["normal", "below_normal"], default="normal",
                   help="under CUDA MPS: the prefill process's scheduling priority (below_normal: the decode "
                   "process's kernels are given SMs first, the prefill's fill what is left)")
    p.add_argument("--out", default=None, help="directory for disagg.json")
    args = p.parse_args()
    import torch

    from kvserve.config import parse_size
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.prefill_device = args.prefill_device or args.device
    for k, v in DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.kv_buffer_size = parse_size(args.kv_buffer_size, "--kv-buffer-size")
    if args.prefill_sm_percent is not None and not 1 <= args.prefill_sm_percent <= 100:
        p.error(f"--prefill-sm-percent must be in [1, 100], got {args.prefill_sm_percent}")
    if args.connector is None:
        one_gpu = args.device.startswith("cuda") and torch.device(args.device) == torch.device(args.prefill_device)
        args.connector = "CudaIpcConnector" if one_gpu else "TorchDistributedConnector"
    res = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count()}
    for name in SETUPS:
        if args.only in (None, name):
            res[name] = run_isolated(name, args)
            print(f"{name}: {json.dumps(res[name].get('decode', res[name]))}", flush=True)
            res["ratios"] = ratios(res)
            if args.out:  # (after each setup: a run cut short keeps what it measured)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "disagg.json"), "w") as f:
                    json.dump(res, f, indent=1)
    print_table(res)


def print_table(res: dict) -> None:
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    r = res["ratios"]
    print("| setup | decode TTFT p50 ms | ITL p50 ms | ITL p99 ms | p99 / baseline | ITL max ms | decode tok/s "
          "| tok/s / baseline | long TTFT p50 ms | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in SETUPS:
        if name not in res:
            continue
        if "error" in res[name]:
            print(f"| {name} | failed: {res[name]['error'][:200]} |")
            continue
        d, lg = res[name]["decode"], res[name]["long"]
        print(f"| {name} | {fmt(d['ttft_p50_ms'])} | {fmt(d['itl_p50_ms'])} | {fmt(d['itl_p99_ms'])} | "
              f"{fmt(r.get(f'{name}_itl_p99_vs_baseline'), '{:.2f}x')} | {fmt(d['itl_max_ms'])} | "
              f"{fmt(d['tokens_per_s'])} | {fmt(r.get(f'{name}_tokens_per_s_vs_baseline'), '{:.2f}x')} | "
              f"{fmt(lg['ttft_p50_ms'])} | {res[name]['wall_s']:.1f} |")
    if "tokens_received" in res.get("disagg", {}):
        print(f"disagg: {res['disagg']['tokens_received']} of {res['disagg']['tokens_handed_over']} long-prompt "
              f"tokens taken from the prefill engine's KV instead of computed")


if __name__ == "__main__":
    main()
