"""An engine's first requests against the same requests again: what a server's first users wait
for beyond a warm engine's time, and the Triton kernels compiled after start-up that cause it.

    PYTHONPATH=$PWD python benchmarks/first_requests.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/first_requests.py --draft dummy:llama-3.2-1b --out $OUT

One engine (``--model``, with ``--draft`` a draft model of ``num_speculative_tokens`` 3) serves a
fixed list of batches of random prompts (1 to 4,000 tokens, 1 to 64 prompts, 24 new tokens each,
half of each prompt repeated so that n-gram drafts would find matches), then the same list again.
Every Triton compile after start-up is recorded (``triton.knobs.runtime.jit_cache_hook``) with
the batch it fell in. Meant for CUDA: on the CPU nothing is compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402

COMPILES: list[dict] = []
PHASE = ["start-up"]


def _hook(**kw) -> bool:
    COMPILES.append({"batch": PHASE[0], "kernel": kw["fn"].name, "constants": repr(kw["compile"]["constants"])})
    return False  # compile as usual


def batches(max_len: int) -> list[list[int | None]]:
    """Prompt lengths per batch (None: drawn from 1..900)."""
    return [[37], [300], [65, 700], [None] * 8, [512] * 32, [min(2000, max_len // 2), 17, 1], [None] * 17,
            [512] * 32, [None] * 64, [None] * 5, [max_len - 100]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--draft", default=None, help="a draft model (method draft_model); none by default")
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--max-model-len", type=int, default=4200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    triton.knobs.runtime.jit_cache_hook = _hook
    kw = {}
    if a.draft:
        kw["speculative_config"] = {"method": "draft_model", "model": a.draft, "num_speculative_tokens": 3}
    t0 = time.perf_counter()
    llm = LLM(a.model, show_progress=False, max_num_seqs=128, kv_cache_memory=a.kv_cache_memory,
              max_model_len=a.max_model_len, **kw)
    startup = time.perf_counter() - t0
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(0)
    rows = []
    for rnd in ("first", "again"):
        for i, lens in enumerate(batches(a.max_model_len)):
            lens = [n or rng.randint(1, 900) for n in lens]
            PHASE[0] = f"{rnd}:{i}"
            n0 = len(COMPILES)
            prompts = [[rng.randint(100, vocab - 1) for _ in range(max(1, n // 2))] * 2 for n in lens]
            sync()
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
            sync()
            rows.append({"round": rnd, "batch": i, "prompts": len(lens), "seconds": time.perf_counter() - t,
                         "compiles": len(COMPILES) - n0,
                         "kernels": sorted({c["kernel"] for c in COMPILES[n0:]})})
            r = rows[-1]
            print(f"{rnd:5s} batch {i:2d} ({r['prompts']:2d} prompts) {r['seconds']:7.3f} s, "
                  f"{r['compiles']} compiles {r['kernels']}", flush=True)
    first = sum(r["seconds"] for r in rows if r["round"] == "first")
    again = sum(r["seconds"] for r in rows if r["round"] == "again")
    after = [c for c in COMPILES if c["batch"] != "start-up"]
    print(f"start-up {startup:.1f} s ({llm.engine.startup_seconds.get('eager_warmup', 0):.1f} s of it the eager "
          f"warm-up); first pass {first:.2f} s, again {again:.2f} s; {len(after)} compiles after start-up")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        card = "cpu" if device == "cpu" else device.split()[1].lower()  # "NVIDIA H100 80GB HBM3": h100
        name = f"first_requests_{card}{'_draft' if a.draft else ''}.json"
        with open(os.path.join(a.out, name), "w") as f:
            json.dump({"args": vars(a), "device": device, "startup_s": startup,
                       "startup_seconds": llm.engine.startup_seconds, "batches": rows, "compiles": COMPILES},
                      f, indent=1)


if __name__ == "__main__":
    main()
