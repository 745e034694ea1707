"""Tile sweep for the skinny-GEMM kernel (``kvserve/kernels/gemv.py``) against cuBLAS at the
Llama-3-8B decode shapes, on the GPU. Its results set ``gemv.default_config`` for several rows
and ``KernelConfig.gemv_max_rows_*``. The one-row default does not come from here: timed alone, a
kernel has no previous kernel to overlap its prefetch with (PDL), and this sweep ranks the
one-row prefetch variants the other way from the engine's batch-1 decode. Try one-row changes in
the engine.

    PYTHONPATH=$PWD python benchmarks/gemv_tune.py --out $OUT

Bandwidth = weight bytes / time (x and y are negligible); L2 is flushed between repetitions, as a
decode step finds each matrix cold.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.testing

from kvserve.kernels.gemv import default_config, gemv
from kvserve.kernels.silu_mul import silu_and_mul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up+silu": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up+silu": 32, "down": 32, "lm_head": 1}  # matrices per decode step


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--quick", action="store_true", help="default configs only, no sweep")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {name: torch.randn(N, K, device=dev, dtype=dt, generator=g) * K ** -0.5
               for name, (N, K) in SHAPES.items()}
    res: dict = {"sweep": {}, "rows": {}}
    sweep_1 = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
               for bn, bk, w, s in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048), (4, 8), (1, 3))
               if bn * bk <= 16384]
    sweep_m = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
               for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4))]
    best: dict = {}
    for name, w in weights.items():
        silu = name.endswith("silu")
        nbytes = w.numel() * w.element_size()
        for M, sweep in ((1, sweep_1), (4, sweep_m)):
            if args.quick:
                break
            x = torch.randn(M, w.shape[1], device=dev, dtype=dt, generator=g)
            times = {}
            for cfg in sweep:
                try:
                    times[json.dumps(cfg)] = bench(lambda: gemv(x, w, silu_mul=silu, config=cfg))
                except Exception as e:  # out of resources etc.
                    times[json.dumps(cfg)] = None
                    print(name, M, cfg, repr(e)[:100])
            ok = {k: v for k, v in times.items() if v}
            top = sorted(ok, key=ok.get)[:5]
            res["sweep"][f"{name},M={M}"] = {k: round(nbytes / ok[k] / 1e12, 3) for k in top}
            best[(name, M)] = json.loads(top[0])
            print(f"{name:14s} M={M:2d} best {top[0]}: {nbytes / ok[top[0]] / 1e12:.2f} TB/s", flush=True)
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, w.shape[1], device=dev, dtype=dt, generator=g)
            if silu:
                cublas = bench(lambda: silu_and_mul(torch.nn.functional.linear(x, w)))
            else:
                cublas = bench(lambda: torch.nn.functional.linear(x, w))
            ref = torch.nn.functional.linear(x.float(), w.float())
            if silu:
                a, b = ref.chunk(2, -1)
                ref = torch.nn.functional.silu(a) * b
            row = {"cublas_tb_s": nbytes / cublas / 1e12, "cublas_us": cublas * 1e6}
            for label, cfg in (("default", None), ("best", best.get((name, 1 if M == 1 else 4)))):
                if label == "best" and cfg is None:
                    continue
                y = gemv(x, w, silu_mul=silu, config=cfg)
                t = bench(lambda: gemv(x, w, silu_mul=silu, config=cfg))
                row[f"{label}_tb_s"] = nbytes / t / 1e12
                row[f"{label}_us"] = t * 1e6
                row[f"{label}_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            res["rows"][f"{name},M={M}"] = row
            print(f"{name:14s} M={M:2d} cuBLAS {row['cublas_tb_s']:.2f} TB/s  ours(default) "
                  f"{row['default_tb_s']:.2f} TB/s ({row['default_rel_err']:.1e})"
                  + (f"  ours(best) {row['best_tb_s']:.2f}" if "best_tb_s" in row else ""), flush=True)
    for M in map(int, args.rows.split(",")):
        tot = {k: sum(PER_STEP[n] * res["rows"][f"{n},M={M}"][f"{k}_us"] for n in SHAPES)
               for k in ("cublas", "default")}
        res["rows"][f"per_step,M={M}"] = tot
        print(f"per decode step (32 layers + lm_head), M={M}: cuBLAS {tot['cublas'] / 1e3:.3f} ms, "
              f"ours {tot['default'] / 1e3:.3f} ms", flush=True)
    res["default_config_M1"] = default_config(1, 4096, 4096)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv_tune.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
