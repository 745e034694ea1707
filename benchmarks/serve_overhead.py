"""`kvserve serve` under load at several client counts, and its overhead against the offline engine.

Starts a real server process on loopback, runs `kvserve bench serve` (the same code as the CLI)
at each concurrency, then runs the offline engine (same model, same max_num_seqs) on exactly the
prompts of the largest-concurrency pass and compares output tokens/s. Prints a table; writes the
bench JSON and latency CDF plots under --out-dir.

    python benchmarks/serve_overhead.py                   # default model, CPU, 1/8/32 clients
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench import plots, report  # noqa: E402
from kvserve.bench.serve import BenchConfig, run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--input-len", default="64,256", help="prompt words, uniform in [min,max]")
    ap.add_argument("--output-len", default="32,128", help="output tokens, uniform in [min,max]")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--out-dir", default="benchmarks/results/serve_cpu")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    in_len = tuple(int(x) for x in args.input_len.split(","))
    out_len = tuple(int(x) for x in args.output_len.split(","))
    os.makedirs(args.out_dir, exist_ok=True)

    port = _free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--served-model-name", "m",
           "--max-num-seqs", str(args.max_num_seqs)] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    runs, cfgs = [], {}
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        for c in levels:
            cfg = BenchConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m", concurrency=c,
                              num_requests=max(args.min_requests, c * args.requests_per_client),
                              input_len=in_len, output_len=out_len, seed=c)
            cfgs[c] = cfg
            runs += run(cfg)["runs"]
            print(f"concurrency {c}: done", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    # The offline engine on the prompts of the largest pass.
    big = max(levels)
    sessions = cfgs[big].sessions()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, show_progress=False)
    prompts = [s.turns[0].prompt for s in sessions]
    params = [SamplingParams(max_tokens=s.turns[0].output_len, temperature=0, ignore_eos=True) for s in sessions]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    offline_tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    http_tok_s = runs[-1]["summary"]["output_token_throughput"]

    for r in runs:
        r.pop("requests", None)
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model or "SmolLM2-135M-Instruct (default)",
              "runs": runs, "offline_out_tok_s": offline_tok_s, "http_out_tok_s_at_max_concurrency": http_tok_s,
              "http_over_offline": http_tok_s / offline_tok_s}
    with open(os.path.join(args.out_dir, "serve_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    plots.write_all(runs, None, args.out_dir)
    print(report.table(runs))
    print(f"\noutput tok/s at {big} clients: HTTP {http_tok_s:.1f}, offline engine {offline_tok_s:.1f} "
          f"(same prompts) -> HTTP/offline = {http_tok_s / offline_tok_s:.2f}")


if __name__ == "__main__":
    main()
