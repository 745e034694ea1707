"""Sliding-window KV: what freeing out-of-window blocks saves, and what window skipping saves in
the decode step. One run on the GPU:

    PYTHONPATH=$PWD python benchmarks/window_kv.py --out $OUT

and on the CPU (the KV accounting only, on Gemma-3-270M's KV shape with a tiny body):

    PYTHONPATH=$PWD python benchmarks/window_kv.py --out $OUT --only kv --models dummy:gemma-3-270m-kv \\
        --contexts 4096 --budget 2048

Sections (JSON saved after each, a table printed last):

* ``kv <model>`` - KV bytes per token by the engine's own pool accounting (blocks in use x bytes per
  block / tokens held) for one request at each context, ``window_kv="free"`` against ``"keep"``
  (every layer's KV of every token: the bytes of the same model with every layer global), and the
  sequences of that context one GiB of KV holds under each. Default models: Gemma-3-270M's and
  Gemma-3-27B's shapes (``dummy:`` weights).
* ``kernel``  - one layer's paged decode attention (Triton) at batch ``--batch`` x 32k context with
  Gemma-3-27B's heads (32 query, 16 KV, head 128, bf16): a ``--window`` (4,096) window against
  full attention at 32k and at the window's length; then a decode step's attention of the model
  (52 local layers, 10 global) with the window against every layer global.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_check import RESULTS, TABLE, section  # noqa: E402  (sections, JSON after each)
from benchmarks.kv_eviction import held_at_last_step  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GiB = 2**30
N_DECODE = 16


def kv_per_token(model: str, contexts: list[int], mode: str, budget: int) -> list[dict]:
    """Per context: one request of that many tokens (prompt + ``N_DECODE`` decoded), alone in the
    engine, and the pool's bytes per token held at its last step."""
    from kvserve.models import loader
    arch = loader.resolve(model).arch
    from kvserve.engine.device import auto_dtype
    itemsize = auto_dtype(torch.device(DEV)).itemsize  # the engine's "auto" dtype here
    longest = max(contexts)
    mem = int(arch.kv_bytes_per_token(itemsize) * (longest + 256) * 1.05)  # room with every block kept
    llm = LLM(model, show_progress=False, kv_cache_memory=mem, max_model_len=longest, window_kv=mode,
              enable_prefix_caching=False, max_num_batched_tokens=budget)
    eng = llm.engine
    kv = eng.runner.kv_cache
    page_bytes = kv.nbytes / kv.num_blocks
    groups = eng.kv_plan.groups
    rng = random.Random(0)
    rows = []
    for ctx in contexts:
        prompt = [rng.randrange(3, arch.vocab_size) for _ in range(ctx - N_DECODE)]
        t0 = time.perf_counter()
        held, tokens = held_at_last_step(eng, f"r{ctx}", prompt,
                                         SamplingParams(max_tokens=N_DECODE, temperature=0, ignore_eos=True))
        r = {"model": model, "context": ctx, "mode": mode, "tokens": tokens, "blocks_held": held,
             "block_bytes": page_bytes, "groups": groups.num_groups, "page_layers": groups.page_layers,
             "bytes_per_token": held * page_bytes / tokens, "seconds": round(time.perf_counter() - t0, 1)}
        r["seqs_per_gib"] = GiB / (r["bytes_per_token"] * ctx)
        print(r, flush=True)
        rows.append(r)
    del llm, eng, kv
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_kv(model: str, contexts: list[int], budget: int):
    section(f"kv {model}")(_run_kv)(model, contexts, budget)


def _run_kv(model: str, contexts: list[int], budget: int):
    rows = kv_per_token(model, contexts, "keep", budget) + kv_per_token(model, contexts, "free", budget)
    for ctx in contexts:
        keep, free = (next(r for r in rows if r["context"] == ctx and r["mode"] == m) for m in ("keep", "free"))
        ratio = keep["bytes_per_token"] / free["bytes_per_token"]
        TABLE.append(f"kv {model} ctx {ctx:>6}: all global {keep['bytes_per_token'] / 1024:8.1f} KiB/token "
                     f"({keep['seqs_per_gib']:.2f} seq/GiB), window freed {free['bytes_per_token'] / 1024:8.1f} "
                     f"KiB/token ({free['seqs_per_gib']:.2f} seq/GiB): {ratio:.2f}x less")
    return {"rows": rows}


@section("kernel")
def run_kernel(batch: int, ctx: int, window: int, local_layers: int, global_layers: int):
    import triton.testing

    from kvserve.kernels.decode_attention import paged_decode_attention
    H, KVH, D, bs = 32, 16, 128, 16
    gen = torch.Generator(device=DEV).manual_seed(0)
    bps = math.ceil(ctx / bs)
    kc = torch.randn(batch * bps, bs, KVH, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * bps, device=DEV, generator=gen).to(torch.int32).view(batch, bps)
    q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    scale = D ** -0.5

    def t(length: int, w: int | None) -> float:
        lens = torch.full((batch,), length, dtype=torch.int32, device=DEV)
        return triton.testing.do_bench(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, window=w),
                                       warmup=20, rep=200, return_mode="median") * 1e3  # microseconds
    full, windowed, short = t(ctx, None), t(ctx, window), t(window, None)
    step_window = local_layers * windowed + global_layers * full
    step_full = (local_layers + global_layers) * full
    out = {"batch": batch, "context": ctx, "window": window, "us_full": full, "us_window": windowed,
           "us_full_at_window_len": short, "step_us_window": step_window, "step_us_all_global": step_full}
    TABLE.append(f"decode attention, batch {batch} x {ctx} keys, one layer: full {full:.1f} us, window {window} "
                 f"{windowed:.1f} us, full at {window} keys {short:.1f} us")
    TABLE.append(f"decode step attention ({local_layers} local + {global_layers} global layers): "
                 f"{step_window / 1e3:.2f} ms vs {step_full / 1e3:.2f} ms all global "
                 f"({step_full / step_window:.2f}x)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default="kv,kernel")
    ap.add_argument("--models", default="dummy:gemma-3-270m,dummy:gemma-3-27b")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=4096)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpu_check.OUT_PATH = os.path.join(args.out, "window_kv.json")
    only = set(args.only.split(","))
    RESULTS["gpu"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    if "kv" in only:
        for model in args.models.split(","):
            run_kv(model, [int(c) for c in args.contexts.split(",")], args.budget)
    if "kernel" in only and DEV == "cuda":
        run_kernel(args.batch, 32768, args.window, 52, 10)
    print("\n" + "\n".join(TABLE))


if __name__ == "__main__":
    main()
