"""Cache-aware routing against Ray Serve's routers, on replicated kvserve (`serve --replicas`).

    python benchmarks/routing.py --out benchmarks/results/routing     # CPU: 2 replicas, default model
    python benchmarks/routing.py --workload docqa --out benchmarks/results/routing_docqa

One local Ray instance; for each router in turn (``--routers``: cache-aware, round-robin,
power-of-two) the same application is deployed fresh (cold caches), driven by the same workload,
and deleted. Workload ``chat`` (the default), multi-turn chat: ``--users`` conversations, user u on system prompt
u mod ``--systems`` (each ``--system-words`` random words); each turn adds a short question (after
``--user-words`` words of pasted text: what a user or an agent's tool brings; the first turn
also ``--user-document-words``, a document of the user's own that the conversation is about), asks
for ``--output-tokens`` tokens (greedy, EOS ignored) and streams the reply; the next turn, after
``--think-seconds``, sends the whole conversation so far. Workload ``docqa``, questions on shared
documents: ``--documents`` long documents (``--document-words`` random words each), user u asks
``--turns`` questions on document u mod ``--documents``, each a fresh request (the document as the
system message, then the question; no history), so every user's questions interleave with the
other users' on the same and other documents. Users start spread over one think time.

Per router: prefix hit rate (cached over prompt tokens, as the replicas report them in usage),
time to first token p50/p99 (to the first content chunk), requests and output tokens per second
over the run. JSON per router and a summary under --out; the table last.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve.cli import build_parser, make_engine  # noqa: E402

WORDS = ("cache block token replica router prefix engine stream tensor queue batch kernel memory "
         "layer head scale page table session tier").split()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def turn(client: httpx.AsyncClient, messages: list[dict], args) -> dict:
    body = {"model": "smol", "messages": messages, "max_tokens": args.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, replica = None, [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        replica = r.headers.get("x-kvserve-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["delta"]["content"])
            usage = chunk.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "output": usage["completion_tokens"],
            "replica": replica, "latency": time.perf_counter() - t0}


async def user(client, uid: int, systems: list[str], args, log: list) -> None:
    rng = random.Random(uid)
    messages = [{"role": "system", "content": systems[uid % len(systems)]}]
    await asyncio.sleep(rng.random() * args.think_seconds)
    for t in range(args.turns):
        words = args.user_words + (args.user_document_words if t == 0 else 0)
        pasted = " ".join(rng.choice(WORDS) for _ in range(words))
        question = f"User {uid}, question {t}: what about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
        messages.append({"role": "user", "content": f"{pasted}\n\n{question}" if pasted else question})
        rec = await turn(client, messages, args)
        log.append({"user": uid, "turn": t, **{k: v for k, v in rec.items() if k != "text"}})
        messages.append({"role": "assistant", "content": rec["text"]})
        await asyncio.sleep(args.think_seconds)


async def reader(client, uid: int, documents: list[str], args, log: list) -> None:
    rng = random.Random(uid)
    await asyncio.sleep(rng.random() * args.think_seconds)
    for t in range(args.turns):
        messages = [{"role": "system", "content": documents[uid % len(documents)]},
                    {"role": "user", "content": f"Reader {uid}, question {t}: where does the document mention the "
                     f"{rng.choice(WORDS)} and the {rng.choice(WORDS)}?"}]
        rec = await turn(client, messages, args)
        log.append({"user": uid, "turn": t, **{k: v for k, v in rec.items() if k != "text"}})
        await asyncio.sleep(args.think_seconds)


async def workload(url: str, args) -> dict:
    rng = random.Random(0)
    if args.workload == "docqa":
        texts = [" ".join(rng.choice(WORDS) for _ in range(args.document_words)) for _ in range(args.documents)]
        run = reader
    else:
        texts = [" ".join(rng.choice(WORDS) for _ in range(args.system_words)) for _ in range(args.systems)]
        run = user
    log: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run(client, u, texts, args, log) for u in range(args.users)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in log if r["ttft"] is not None]
    prompt, cached = sum(r["prompt"] for r in log), sum(r["cached"] for r in log)
    per_replica: dict[str, int] = {}
    for r in log:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {"requests": len(log), "wall_s": wall, "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "cached_tokens": cached, "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p99_s": pct(ttfts, 0.99), "requests_per_s": len(log) / wall,
            "output_tok_per_s": sum(r["output"] for r in log) / wall, "requests_per_replica": per_replica,
            "log": log}


def wait_ready(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the application did not become ready")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--routers", default="cache-aware,round-robin,power-of-two")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus-per-replica", type=float, default=0.5)
    p.add_argument("--gpus-per-replica", type=float, default=0.0)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--workload", choices=("chat", "docqa"), default="chat")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--documents", type=int, default=4, help="docqa: shared documents")
    p.add_argument("--document-words", type=int, default=800, help="docqa: words per document")
    p.add_argument("--user-words", type=int, default=0,
                   help="chat: words of pasted text in each user turn, before its question")
    p.add_argument("--user-document-words", type=int, default=0,
                   help="chat: words of a document of the user's own pasted into the first turn")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think-seconds", type=float, default=1.0)
    p.add_argument("--port", type=int, default=18590)
    args = p.parse_args()

    import ray
    from ray import serve

    from kvserve.cluster.launch import APP_NAME, application

    serve_args = ["serve", "--replicas", str(args.replicas), "--cpus-per-replica", str(args.cpus_per_replica),
                  "--gpus-per-replica", str(args.gpus_per_replica), "--served-model-name", "smol",
                  "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "4096"]
    if args.model:
        serve_args += ["--model", args.model]
    sargs = build_parser().parse_args(serve_args)
    os.makedirs(args.out, exist_ok=True)
    ray.init(include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    results = {}
    try:
        for router in args.routers.split(","):
            serve.run(application(sargs, make_engine, router), name=APP_NAME, route_prefix="/")
            wait_ready(url)
            print(f"=== {router}", file=sys.stderr, flush=True)
            res = asyncio.run(workload(url, args))
            with open(os.path.join(args.out, f"{router}.json"), "w") as f:
                json.dump(res, f, indent=1)
            results[router] = {k: v for k, v in res.items() if k != "log"}
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {"config": vars(args), "results": results}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    shared = (f"{args.documents} documents of {args.document_words} words, one question a request"
              if args.workload == "docqa" else f"{args.systems} system prompts of {args.system_words} words")
    print(f"\n{args.workload}: {args.replicas} replicas, {args.users} users x {args.turns} turns, {shared}, "
          f"{args.user_document_words} words of a user document, {args.user_words} words pasted a turn, "
          f"{args.output_tokens} output tokens, think {args.think_seconds}s")
    print("| router | prefix hit rate | prompt tokens computed | TTFT p50 / p99 (ms) | req/s | out tok/s "
          "| requests per replica |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- |")
    for router, r in results.items():
        print(f"| {router} | {r['prefix_hit_rate']:.1%} | {r['prompt_tokens'] - r['cached_tokens']:,} "
              f"| {r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} "
              f"| {r['requests_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
              f"{' / '.join(str(n) for n in sorted(r['requests_per_replica'].values()))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
