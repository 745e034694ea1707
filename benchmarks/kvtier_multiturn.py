"""Multi-turn chat through the async engine, KV tiers off against on.

    PYTHONPATH=$PWD python benchmarks/kvtier_multiturn.py --out $OUT                   # GPU, 8B shape
    python benchmarks/kvtier_multiturn.py --model dummy:tiny --users 8 --turns 3 --system-tokens 256 \\
        --kv-memory 2MiB --cpu-kv-memory 64MiB --time-scale 0.01 --out /tmp/mt          # CPU smoke

``--users`` conversations share a ``--system-tokens`` system prompt; each turn adds
``--user-tokens`` tokens, asks for ``--output-tokens`` tokens, then the user "thinks" for
``--think-seconds`` × ``--time-scale`` (stated in the output) before the next turn, whose prompt is
the whole conversation so far. Every request carries its ``session_id``, so with tiers on an idle
conversation leaves the GPU after ``--idle-offload-seconds`` × time scale and its next turn loads it.

Reported per configuration: time to first token p50/p99 over all turns after the first, prompt
tokens computed against served from the GPU prefix cache and from the tiers, and the sessions
whose last turn found its history (GPU or tiers) instead of recomputing it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.async_engine import AsyncEngine  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def conversation(ae: AsyncEngine, uid: int, system: list[int], args, vocab: int, log: list) -> None:
    rng = random.Random(uid)
    history = list(system)
    think = args.think_seconds * args.time_scale
    await asyncio.sleep(rng.random() * think)  # users arrive spread over one think time
    for turn in range(args.turns):
        history += [rng.randrange(vocab) for _ in range(args.user_tokens)]
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        first = None
        out = None
        async for out in ae.add_request(f"u{uid}-t{turn}", {"prompt_token_ids": list(history)}, params,
                                        session_id=f"user-{uid}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
        m = out.metrics
        log.append({"user": uid, "turn": turn, "ttft": first, "prompt": len(history),
                    "cached": m.num_cached_tokens, "loaded": m.num_loaded_tokens})
        history += out.outputs[0].token_ids
        await asyncio.sleep(think)


async def run_config(args, tiers: bool) -> dict:
    kw = dict(cpu_kv_memory=args.cpu_kv_memory, idle_offload_seconds=args.idle_offload_seconds * args.time_scale)
    if args.disk_kv_dir:
        kw["disk_kv_dir"] = args.disk_kv_dir
    llm = LLM(args.model, kv_cache_memory=args.kv_memory, max_num_seqs=args.users, show_progress=False,
              max_model_len=args.system_tokens + args.turns * (args.user_tokens + args.output_tokens) + 16,
              **(kw if tiers else {}))
    eng = llm.engine
    vocab = eng.arch.vocab_size
    runner_offload = {"seconds": 0.0, "blocks": 0, "calls": 0}
    if tiers:  # copies of blocks out of the GPU on the engine thread (evictions, sessions)
        real = eng.tiers.offload

        def timed_offload(data, blocks, *a, **kw):
            t = time.perf_counter()
            try:
                return real(data, blocks, *a, **kw)
            finally:
                runner_offload["seconds"] += time.perf_counter() - t
                runner_offload["blocks"] += len(blocks)
                runner_offload["calls"] += 1
        eng.tiers.offload = timed_offload
    system = [random.Random(0).randrange(vocab) for _ in range(args.system_tokens)]
    ae = AsyncEngine(eng)
    ae.start()
    log: list = []
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(ae, u, system, args, vocab, log) for u in range(args.users)))
    finally:
        ae.shutdown()
    wall = time.perf_counter() - t0
    later = [r for r in log if r["turn"] > 0]
    last = [r for r in log if r["turn"] == args.turns - 1]
    history_reused = sum(1 for r in last if r["cached"] + r["loaded"] >= args.system_tokens + args.user_tokens)
    res = {"tiers": tiers, "wall_s": wall, "turns": len(log),
           "ttft_p50": pct([r["ttft"] for r in later], 0.5), "ttft_p99": pct([r["ttft"] for r in later], 0.99),
           "prompt_tokens": sum(r["prompt"] for r in log), "cached_tokens": sum(r["cached"] for r in log),
           "loaded_tokens": sum(r["loaded"] for r in log),
           "recomputed_tokens": sum(r["prompt"] - r["cached"] - r["loaded"] for r in log),
           "sessions_with_history_reused_at_last_turn": history_reused, "gpu_kv_blocks": eng.num_kv_blocks,
           "engine_busy_s": eng.stats.busy_time, "engine_steps": eng.stats.num_steps,
           "runner_offload": runner_offload if tiers else None,
           "store": eng.store.snapshot() if eng.store is not None else None}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--think-seconds", type=float, default=30.0)
    ap.add_argument("--idle-offload-seconds", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=0.05, help="think and idle times are multiplied by this")
    ap.add_argument("--kv-memory", default="4GiB", help="GPU KV pool: small enough that not every session fits")
    ap.add_argument("--cpu-kv-memory", default="32GiB")
    ap.add_argument("--disk-kv-dir", default=None)
    ap.add_argument("--out", default="benchmarks/results/kvtier")
    args = ap.parse_args()
    results = [asyncio.run(run_config(args, tiers=False)), asyncio.run(run_config(args, tiers=True))]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kvtier_multiturn.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "results": results}, f, indent=1, default=str)
    print(f"{args.users} users x {args.turns} turns, system prompt {args.system_tokens} tokens, think time "
          f"{args.think_seconds} s x {args.time_scale} = {args.think_seconds * args.time_scale:.2f} s")
    for r in results:
        print(f"tiers {'on ' if r['tiers'] else 'off'}: TTFT p50 {r['ttft_p50'] * 1e3:8.1f} ms  p99 "
              f"{r['ttft_p99'] * 1e3:8.1f} ms  recomputed {r['recomputed_tokens']:8d}  from GPU cache "
              f"{r['cached_tokens']:8d}  from tiers {r['loaded_tokens']:8d}  sessions reusing history at the last "
              f"turn {r['sessions_with_history_reused_at_last_turn']}/{args.users}  wall {r['wall_s']:.1f} s  "
              f"engine busy {r['engine_busy_s']:.1f} s")
        if r["store"] is not None:
            ld, cm = r["store"]["load"], r["store"]["cost_model"]
            print(f"          copies out: {ld['session_blocks_written']} at turn ends + {ld['offloaded_blocks']} "
                  f"evicted ({r['runner_offload']['seconds']:.2f} s), {ld['offloads_skipped']} skipped (held); "
                  f"offload {ld['offload_seconds']:.2f} s, load {ld['load_seconds']:.2f} s; "
                  f"prefill estimate {cm['prefill_tokens_per_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
