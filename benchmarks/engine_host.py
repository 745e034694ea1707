"""The engine's host time per step at large batch, for comparing two trees of kvserve.

It uses only the public engine API (``LLM``, ``SamplingParams``, ``engine.step``), so one copy of
this file runs against any tree: the tree is the one on ``PYTHONPATH``.

``--device cpu``: ``dummy:tiny`` with the model's forward replaced by zeros, so a step is the
engine's Python only (scheduling, launch bookkeeping, sampling rows, the update, the output
processor, stats). ``--requests`` at once, greedy, ``--max-tokens`` each, EOS ignored; reports
the engine thread's CPU time per step (steadier than wall time on a shared machine) and the
wall time.

``--device cuda``: Llama-3-8B-shaped dummy bf16 weights, the offline workload of gpu_check.py
(prompts of uniform length in [128, 1024] tokens, 256 new tokens, EOS ignored) at each of
``--sizes`` requests after one untimed run of the first size, then batch-1 decode (512-token
prompt, 256 new tokens); reports wall time, output tokens/s and the GPU's busy time.

    PYTHONPATH=/path/to/tree python benchmarks/engine_host.py --device cpu --out OUT/head
    bash benchmarks/compare_builds.sh build/base OUT host      # the H200 pass, builds alternating
    python benchmarks/engine_host.py --summarize OUT           # a table of OUT/{base,head}-*.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import time


def cpu_run(args) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    torch.set_num_threads(1)
    llm = LLM("dummy:tiny", device="cpu", max_num_seqs=args.requests, max_num_batched_tokens=8192,
              kv_cache_memory=256 << 20, show_progress=False, async_scheduling=args.async_scheduling)
    hidden = llm.engine.arch.hidden_size
    llm.engine.runner.model.forward = lambda ids, positions: torch.zeros(ids.shape[0], hidden)
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(16, 64))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)
    s0, w0, c0 = llm.engine.stats.num_steps, time.perf_counter(), time.thread_time()
    for _ in range(args.repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    steps = llm.engine.stats.num_steps - s0
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    return {"requests": args.requests, "steps": steps, "cpu_ms_per_step": cpu / steps * 1e3,
            "wall_ms_per_step": wall / steps * 1e3}


def cuda_run(args) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.engine.model_runner import GpuTimer
    llm = LLM("dummy:llama-3-8b", device="cuda", dtype="bfloat16", kv_cache_memory=args.kv_memory,
              max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=9216, show_progress=False)
    eng = llm.engine
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)

    def run(prompts, tag) -> dict:
        eng.kv.pool.reset_prefix_cache()  # every run prefills its prompts
        for i, p in enumerate(prompts):
            eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
        torch.cuda.synchronize()
        timer = eng.runner.gpu_timer = GpuTimer()
        n_out, steps, t0 = 0, 0, time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step(only_finished=True):
                n_out += len(o.outputs[0].token_ids)
            steps += 1
        dt = time.perf_counter() - t0
        eng.runner.gpu_timer = None
        assert n_out == 256 * len(prompts)
        return {"seconds": dt, "out_tok_s": n_out / dt, "steps": steps, "gpu_busy_s": timer.seconds}

    res = {}
    sizes = [int(s) for s in args.sizes.split(",")]
    for k, n in enumerate(sizes):
        rng = random.Random(10 + n)
        prompts = [[rng.randrange(128000) for _ in range(rng.randint(128, 1024))] for _ in range(n)]
        if k == 0:
            run(prompts, "warm")  # kernel variants of every step shape compile here, untimed
        res[f"offline_{n}"] = run(prompts, f"off{n}")
    rng = random.Random(3)
    one = [[rng.randrange(128000) for _ in range(512)]]
    run(one, "warm1")
    res["batch1_512"] = run(one, "b1")
    return res


def summarize(out: str) -> None:
    """One row per figure: each build's runs in order, and the head/base ratio of each pair."""
    runs = {b: [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, f"{b}-*.json")))]
            for b in ("base", "head")}
    if not runs["base"] or not runs["head"]:
        print(f"no base-*.json and head-*.json in {out}")
        return
    keys = [k for k, v in runs["head"][0].items() if isinstance(v, dict)] or [None]
    rows = []
    for k in keys:
        for field in ("out_tok_s", "gpu_busy_s", "cpu_ms_per_step", "wall_ms_per_step"):
            vals = {b: [(r[k] if k else r).get(field) for r in runs[b]] for b in runs}
            if None in vals["base"] + vals["head"]:
                continue
            ratios = [h / b for h, b in zip(vals["head"], vals["base"])]
            rows.append((k or "cpu", field, vals["base"], vals["head"], ratios))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump([dict(zip(("run", "figure", "base", "head", "head_over_base"), r)) for r in rows], f, indent=1)
    print("\n| run | figure | base | head | head/base (median; per pair) |\n|---|---|---|---|---|")
    for run, field, b, h, q in rows:
        fmt = lambda xs: " / ".join(f"{x:.4g}" for x in xs)  # noqa: E731
        print(f"| {run} | {field} | {fmt(b)} | {fmt(h)} | {statistics.median(q):.3f}; {fmt(q)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", help="folder for this run's JSON (name: --tag, then a number)")
    ap.add_argument("--tag", default="head", help="the build's name in the file name: base or head")
    ap.add_argument("--requests", type=int, default=256, help="cpu: requests at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="cpu: new tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="cpu: timed runs of the workload")
    ap.add_argument("--async-scheduling", type=int, default=1, help="cpu: 1 as on CUDA (the default there), 0 off")
    ap.add_argument("--sizes", default="256,1024", help="cuda: offline request counts")
    ap.add_argument("--kv-memory", default="40GiB")
    ap.add_argument("--summarize", metavar="OUT", help="print the table of OUT's runs and write OUT/summary.json")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    res = cpu_run(args) if args.device == "cpu" else cuda_run(args)
    print(json.dumps(res))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        n = len(glob.glob(os.path.join(args.out, f"{args.tag}-*.json")))
        with open(os.path.join(args.out, f"{args.tag}-{n:02d}.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
