"""Decode attention at small batches, by how the context is split (CUDA): the engine's launch
(``decode_splits``' count, the fused RoPE + KV write, PDL) against other split counts, 32-key
tiles and 8 warps, at contexts from 128 to 32k keys. Llama-3-8B's heads (32 query, 8 KV, 128
wide), a bf16 cache of 16-token pages; 32 layers, each with its own cache, in one CUDA graph (as
a decode step runs them), microseconds a layer. Every output is checked against the engine
launch's. (Without CUDA the kernels run in Triton's interpreter, a check of the script only:
``TRITON_INTERPRET=1``, small contexts.)

    PYTHONPATH=$PWD python benchmarks/attention_splits.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/attention_splits.py --batches 1,8 --contexts 512,4096 --out $OUT

Prints a line per (batch, context) and saves ``attention_splits.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.weight_quant import graph_time  # noqa: E402
from kvserve.kernels.common import RopeWrite, SplitCounters  # noqa: E402
from kvserve.kernels.decode_attention import decode_splits, paged_decode_attention  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402

H, KVH, D, PAGE, LAYERS = 32, 8, 128, 16, 32
# (the CPU runs the kernels in Triton's interpreter: a check of this script at small contexts)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = (4, 8, 16)


def layers(batch: int, ctx: int, gen: torch.Generator) -> list[dict]:
    """Per layer: a cache of ``batch`` sequences of ``ctx`` keys (the last this step's, written
    by the kernel), its block table, and this step's q, k, v before RoPE."""
    pages = -(-ctx // PAGE)
    tables = torch.arange(batch * pages, dtype=torch.int32, device=DEV).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    pos = lens.long() - 1
    slots = tables[torch.arange(batch, device=DEV), pos // PAGE].long() * PAGE + pos % PAGE
    out = []
    for _ in range(LAYERS):
        kc = torch.randn(batch * pages, PAGE, KVH, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        qkv = torch.randn(batch, (H + 2 * KVH) * D, device=DEV, dtype=torch.bfloat16, generator=gen)
        q, k, v = (t.view(batch, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        out.append(dict(kc=kc, vc=torch.randn_like(kc), q=q, k=k, v=v, tables=tables, lens=lens, pos=pos,
                        slots=slots, out=torch.empty_like(q)))
    return out


def cpu_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--contexts", default="128,512,1024,2048,4096,8192,32768")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    rope = RotaryEmbedding(D, 32768 + 1, 500000.0).to(DEV)
    counters = SplitCounters()
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = {}
    for batch in map(int, a.batches.split(",")):
        default_splits = decode_splits(None, batch, KVH, torch.device(DEV))
        configs = {"engine": {}, **{f"{s} splits": {"splits": s} for s in SPLITS if s != default_splits},
                   "32-key tiles": {"block_n": 32}, "8 warps": {"num_warps": 8}}
        for ctx in map(int, a.contexts.split(",")):
            ls = layers(batch, ctx, gen)
            row, ref = {}, None
            for name, launch in configs.items():
                launch = {"splits": default_splits, **launch}

                def step(launch=launch, ls=ls):
                    for x in ls:
                        paged_decode_attention(x["q"], x["kc"], x["vc"], x["tables"], x["lens"], D ** -0.5,
                                               out=x["out"], counters=counters,
                                               rope=RopeWrite(x["pos"], x["slots"], x["k"], x["v"], rope.cos,
                                                              rope.sin), **launch)
                step()
                got = torch.stack([x["out"].float() for x in ls])
                ref = got if ref is None else ref
                us = (graph_time(step) if DEV == "cuda" else cpu_time(step)) / LAYERS * 1e6
                row[name] = {"us_per_layer": us, "max_diff_vs_engine": (got - ref).abs().max().item()}
            res[f"batch {batch}, {ctx} keys"] = row
            base = row["engine"]["us_per_layer"]
            best = min(row, key=lambda n: row[n]["us_per_layer"])
            print(f"batch {batch} ({default_splits} splits), {ctx:6d} keys: engine {base:6.2f} us a layer; "
                  + ", ".join(f"{n} {r['us_per_layer']:.2f}" for n, r in row.items() if n != "engine")
                  + f"; best {best} ({row[best]['us_per_layer'] / base:.2f}x); "
                  f"max diff {max(r['max_diff_vs_engine'] for r in row.values()):.1e}", flush=True)
            del ls
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention_splits.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
                   "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
