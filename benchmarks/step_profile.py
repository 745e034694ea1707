"""Where a batch-1 decode step's time goes on the GPU: each kernel's time a step, by name, and the
GPU's busy time against the step's wall time (the rest: gaps between kernels).

    PYTHONPATH=$PWD python benchmarks/step_profile.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/step_profile.py --cases int4h-nopdl,bf16-nopdl --out $OUT

Llama-3-8B's shape (dummy weights), one sequence: a 512-token prompt, 20 steps to warm, then 64
decode steps timed (wall), and 64 more of another sequence under PyTorch's profiler (CUDA
activity: the kernels inside the step's CUDA graph). Cases: the weights (``bf16``, ``int8h``:
int8 with the int8 head, ``int4h``: int4 in groups of 128 with the int8 head), and ``-nopdl``
without programmatic dependent launch, where each kernel's time is its own (with it, a kernel
starts early and its time includes the wait on the one before). Needs CUDA.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402

WEIGHTS = {"bf16": {}, "int8h": dict(quantization="int8", quantization_head="int8"),
           "int4h": dict(quantization="int4", quantization_group_size=128, quantization_head="int8")}
STEPS = 64


def case_options(name: str) -> dict:
    weights, _, opt = name.partition("-")
    if weights not in WEIGHTS or opt not in ("", "nopdl"):
        raise SystemExit(f"--cases: {name!r} is not one of {', '.join(WEIGHTS)} (with -nopdl or not)")
    return dict(WEIGHTS[weights], **({"kernel": KernelConfig(pdl=False)} if opt else {}))


def busy_time(events) -> float:
    """The union of the events' time ranges (µs): when the GPU ran at least one kernel or copy."""
    busy, end = 0.0, None
    for e in sorted(events, key=lambda e: e.time_range.start):
        s, t = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            busy, end = busy + t - s, t
        elif t > end:
            busy, end = busy + t - end, t
    return busy


def run(name: str, prompt: list[int]) -> dict:
    llm = LLM("dummy:llama-3-8b", dtype="bfloat16", kv_cache_memory="8GiB", max_num_seqs=8,
              max_model_len=2048, show_progress=False, **case_options(name))
    eng = llm.engine
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    wall = None
    for rep in range(2):
        eng.add_request(f"{name}-{rep}", {"prompt_token_ids": prompt}, params)
        for _ in range(20):
            eng.step()
        torch.cuda.synchronize()
        if rep == 0:
            t0 = time.perf_counter()
            for _ in range(STEPS):
                eng.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / STEPS * 1e6
        else:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    eng.step()
                torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            eng.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        k = by_name[e.name[:60]]
        k[0] += 1
        k[1] += e.time_range.end - e.time_range.start
    kernels = sorted(((t / STEPS, n / STEPS, name) for name, (n, t) in by_name.items()), reverse=True)
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / STEPS
    del llm, eng, prof
    gc.collect()
    torch.cuda.empty_cache()
    return {"wall_us": wall, "span_us": span, "busy_us": busy_time(events) / STEPS, "kernels": kernels[:30]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="int4h-nopdl,int4h",
                    help="comma-separated: bf16, int8h, int4h, each with -nopdl or not")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    names = a.cases.split(",")
    for name in names:
        case_options(name)
    rng = random.Random(7)
    prompt = [rng.randrange(128000) for _ in range(512)]
    res = {}
    for name in names:
        r = res[name] = run(name, prompt)
        print(f"== {name}: step wall {r['wall_us']:.1f} us; profiled span {r['span_us']:.1f} us a step, "
              f"GPU busy {r['busy_us']:.1f}, kernels {sum(k[1] for k in r['kernels']):.0f} a step", flush=True)
        for us, n, k in r["kernels"][:12]:
            print(f"  {us:8.1f} us a step {n:6.1f} a step {us / max(n, 1e-9):7.2f} us each  {k}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "step_profile.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": res}, f, indent=1)


if __name__ == "__main__":
    main()
