"""Launch-configuration sweep of paged decode attention over compressed KV caches (CUDA), at
batch 32 x 32k-token contexts, Llama-3-8B heads (GQA 32/8, head 128). Each format's cache is
filled by the reference writer, the engine's launch timed first (for KIVI int4: the Gluon
kernel), then every configuration of the Triton kernel's grid against bf16's default. One run:

    PYTHONPATH=$PWD python benchmarks/kv_decode_sweep.py --out $OUT [--seconds 240]
    PYTHONPATH=$PWD python benchmarks/kv_decode_sweep.py --out $OUT --formats fp8,int4 --defaults-only

Prints a line per configuration and saves ``kv_decode_sweep.json``; ``--seconds`` bounds the
sweep (configurations left when it runs out are skipped). The defaults it found are in
``kernels/decode_attention.py`` (``split_per_sm`` and the 8-bit launch)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.kv_compression import _fill, arch_8b, bench, engine_decode  # noqa: E402
from kvserve import kv_format as kf  # noqa: E402
from kvserve.kernels import decode_attention as da  # noqa: E402
from kvserve.kernels.common import SplitCounters  # noqa: E402

# (format, block size): bf16 first, the baseline of the ratios
CACHES = [("auto", 16), ("fp8", 64), ("int8", 64), ("int4", 64), ("int2", 64)]
EIGHT_BIT_GRID = dict(block_n=[64, 32], num_stages=[2, 3], num_warps=[2, 4], per_sm=[8, 16, 32])
KIVI_GRID = dict(num_warps=[2, 4], num_stages=[2, 3], per_sm=[2, 4, 8])


def grid(g: dict) -> list[dict]:
    return [dict(zip(g, values)) for values in itertools.product(*g.values())]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--formats", default=",".join(n for n, _ in CACHES),
                    help="formats to time, comma-separated (bf16, 'auto', is always first: the baseline)")
    ap.add_argument("--defaults-only", action="store_true", help="each format's default launch, no grid")
    args = ap.parse_args()
    wanted = {"auto", *args.formats.split(",")}
    unknown = wanted - {n for n, _ in CACHES}
    if unknown:
        ap.error(f"--formats: unknown {sorted(unknown)}; choose from {[n for n, _ in CACHES]}")
    t_end = time.time() + args.seconds
    a = arch_8b()
    H, D = a.num_heads, a.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(args.batch, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((args.batch,), args.ctx, dtype=torch.int32, device="cuda")
    res, base = {}, None
    counters = SplitCounters()
    for name, bs in CACHES:
        if name not in wanted:
            continue
        f = kf.KVFormat(name, a.num_kv_heads, D, bs, torch.bfloat16)
        (kc, vc), tables, rs = _fill(f, args.batch, args.ctx, gen)
        nbytes = args.batch * args.ctx * f.block_bytes / f.block_size  # codes and scales read
        cfgs = [{}]
        if args.defaults_only:
            pass
        elif name in ("fp8", "int8"):
            cfgs += grid(EIGHT_BIT_GRID)
        elif f.kivi:
            cfgs += grid(KIVI_GRID)
        ref = None
        for cfg in cfgs:
            if time.time() > t_end:
                break
            cfg = dict(cfg)
            per_sm = cfg.pop("per_sm", None)  # (default: the engine's splits)
            launch = dict(cfg)
            if per_sm is not None:
                launch["splits"] = da.num_splits(args.batch, a.num_kv_heads, q.device, per_sm)

            def fn():
                return engine_decode(q, kc, vc, tables, lens, D ** -0.5, rs, counters=counters, **launch)
            o = fn().float()
            ref = o if ref is None else ref
            t = bench(fn)
            base = base or t
            key = f"{name}/bs{bs} {cfg or 'default'} per_sm={per_sm}"
            res[key] = dict(ms=t * 1e3, tb_s=nbytes / t / 1e12, vs_bf16=base / t,
                            max_diff_vs_default=(o - ref).abs().max().item())
            print(f"{key}: {t * 1e3:.3f} ms, {nbytes / t / 1e12:.2f} TB/s, {base / t:.2f}x bf16", flush=True)
        kc = vc = None  # (freed before the next format's cache)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_decode_sweep.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
