"""Weight quantization (``LLM(quantization="int8" | "int4" | "fp8")``, GGUF blocks kept packed):
speed on the GPU, speed and quality on the CPU, peers in the same run.

    PYTHONPATH=$PWD python benchmarks/weight_quant.py --out $OUT              # H200: everything below
    PYTHONPATH=$PWD python benchmarks/weight_quant.py --device cpu --out DIR  # the CPU sections

GPU sections (Llama-3-8B shape, dummy weights; JSON saved after each, a table printed last):
  tests     the quantized kernels' real-size tests (tests/kernels/test_wq_gemm.py -k real_size)
  step      one batch-1 step's projections (32 layers, one CUDA graph): bf16 against each packed
            format's one-row kernels (``--step-sweep``: every tile of STEP_CONFIGS;
            ``--step-formats`` picks the formats, ``--step-per-shape`` also times each projection
            alone)
  dispatch  each decoder projection (qkv, o, gate/up, down) at 1..2,048 rows: bf16 (the faster of
            cuBLAS and kvserve's skinny kernel) against the quantized shapes (skinny, tiled with
            in-register dequantization, dequantize-then-cuBLAS, and from 32 rows the weight-left
            GEMM at each tile of WX_CONFIGS, the best kept); the fastest per row count, the
            choice ``KernelConfig``'s rule makes, and the rule the sweep implies
  engine    per format (bf16, int8, int4 g128, fp8 W8A8, and GGUF Q4_K / Q8_0 blocks: random
            valid blocks of the same shape, since speed depends on shapes): batch-1 decode (512-token prompt, 256 new
            tokens) and offline throughput (256 requests, prompts U[128, 1024], 256 new each);
            the decoded tokens (CUDA graphs, skinny kernels) checked against one prefill of
            prompt + output (eager, the large-batch path): the share it ranks first;
            ``--formats`` picks them, "+wl" for the weight-left GEMM at large batches
  prefill   one 8,192-token prompt per format (``--formats``): ms, TFLOP/s, and the share of
            the same run's dense GEMM ceiling (bf16's; FP8's for fp8)
  split     each projection through the product the rule picks, K summed in 1, 2, 4 or 8
            parts, against bf16 and ``wq_gemm.split_k``'s choice
  s8        each projection at 64..2,048 rows (``--rows``) on the integer tensor cores, x split
            in two int8 halves (``kernels/wq_s8.py``), at each tile of S8_CONFIGS, against bf16
            cuBLAS and the product the default rule picks (weight-left GEMM or
            dequantize-then-cuBLAS), in CUDA graphs over copies of the weights that outgrow L2
  peer      PyTorch's weight-only path as gpt-fast uses it (weight_quant_peer.py): a plain
            Llama of the same shape, decode step under torch.compile, bf16 / int8 / int4 g128
CPU sections (the default model, SmolLM2-135M, float32 activations):
  cpu       batch-1 decode tok/s (64 new tokens) per format: fp32 (the GGUF dequantized at
            load), the GGUF's Q4_1 blocks kept packed, RTN int8 / int4, fp8
  s8-quality  perplexity of int8 and int4 g32 with and without x rounded as the integer
            tensor-core product's split rounds it (``wq_s8.split_rows_ref``, applied to the
            input of every many-row product before the CPU's own; the CPU has no such kernel),
            and with x rounded to one int8 code a value instead
  quality   perplexity over a held-out text (Python's own reference documentation,
            ``pydoc_data.topics``, first 1,024 tokens) per format, against the unquantized model
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_check import RESULTS, TABLE, section  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402
from kvserve.layers.quant_linear import cuda_product, run_cuda_product  # noqa: E402
from kvserve.models.presets import DUMMY_PRESETS  # noqa: E402

GPU_FORMATS = {"bf16": {}, "int8": {"quantization": "int8"},
               "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
               "fp8": {"quantization": "fp8"}, "gguf-Q4_K": {}, "gguf-Q8_0": {}}
# ``--formats`` may add "+wl" to a weight-only format: its large products by the weight-left GEMM
# up to ``--weight-left-max-rows`` (``KernelConfig.wq_weight_left_max_rows``); "+deq": the
# skinny kernel up to 16 rows, the tiled GEMM below 64, dequantize-then-cuBLAS from there;
# "+nosplit": K never split; "+silu" / "+nosilu": the one-row gate/up product's SiLU-and-multiply
# in its kernel (the default) or in one of its own (``KernelConfig.wq_fused_silu``); "+s8" /
# "+nos8": products of ``--s8-min-rows`` to ``--s8-max-rows`` rows on the integer tensor cores
# (``KernelConfig.wq_s8_min_rows``, ``wq_s8_max_rows``; int8 per channel takes 64 to 512 by
# default), or none; "+int8head": the output head in int8; "+noreserve" (any format): admission
# keeps no room for decoding. Options combine ("int4-g128+int8head+nosplit").
# The default model is 576 wide: int4 groups of 128 do not divide it.
CPU_FORMATS = {"fp32": {"quantization": "none"}, "gguf-Q4_1": {"quantization": "gguf"},
               "int8": {"quantization": "int8"},
               "int8-head": {"quantization": "int8", "quantization_head": "int8"},
               "int4-g32-head": {"quantization": "int4", "quantization_group_size": 32, "quantization_head": "int8"},
               "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
               "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
               "fp8": {"quantization": "fp8"}}
# Random GGUF blocks whose weights have a std of about 0.02, as the dummy ones: the float16 super-
# block scale d per type (Q4_K's dmin = 7.5 d centres its codes).
_GGUF_D = {"Q4_K": 8e-5, "Q8_0": 2.7e-4}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3


@section("tests")
def run_tests():
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "real_size",
                        "tests/kernels/test_wq_gemm.py"], capture_output=True, text=True)
    lines = (p.stdout + p.stderr).strip().splitlines()
    print("\n".join(lines[-40:] if p.returncode else lines[-2:]), flush=True)
    TABLE.append(f"tests: {lines[-1] if lines else '?'} (rc {p.returncode})")
    return {"rc": p.returncode, "tail": lines[-3:]}


def rule_choice(rows: int, kernel: KernelConfig, int4: bool) -> str:
    """What layers/quant_linear.py picks for Llama-3-8B's layers (every K a multiple of 128; int8
    per channel, the integer tensor cores' weight: ``wq_s8.dispatched``)."""
    how = cuda_product(rows, kernel, int4, wide=True, s8=not int4)
    return "dequant+cuBLAS" if how == "dequant" else how


@section("dispatch")
def run_dispatch(rows_measured: list[int], skinny_sweep: bool = False):
    import torch.nn.functional as F

    from kvserve.kernels import wq_gemm
    from kvserve.kernels.gemv import MAX_ROWS, gemv
    from kvserve.layers.rtn import quantize_int4, quantize_int8
    kernel = KernelConfig()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for fmt in ("int8", "int4-g128"):
        times = {r: {"bf16": 0.0, "skinny": 0.0, "tiled": 0.0, "dequant+cuBLAS": 0.0, "weight-left": 0.0}
                 for r in rows_measured}
        wx_tiles = {r: {} for r in rows_measured}  # the weight-left GEMM: each tile's time over the shapes
        sk_tiles = {r: {} for r in rows_measured}  # the skinny shape's tiles (--skinny-sweep)
        for N, K in SHAPES.values():
            w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            if fmt == "int8":
                q, s = quantize_int8(w, torch.bfloat16)
                packed = (q, s, None, 0)
            else:
                packed = (*quantize_int4(w, 128, torch.bfloat16), 128)
            tiled = wq_gemm.default_config(wq_gemm.MAX_SKINNY_ROWS + 1, N, K, fmt != "int8")
            for r in rows_measured:
                x = torch.randn(r, K, device="cuda", generator=gen, dtype=torch.bfloat16)
                t = times[r]
                bf16 = bench(lambda: F.linear(x, w))
                if r <= MAX_ROWS:
                    bf16 = min(bf16, bench(lambda: gemv(x, w)))
                t["bf16"] += bf16
                t["skinny"] += bench(lambda: wq_gemm.wq_mm(x, *packed)) if r <= wq_gemm.MAX_SKINNY_ROWS else math.inf
                t["tiled"] += bench(lambda: wq_gemm.wq_mm(x, *packed, config=tiled)) if r > 1 else math.inf
                t["dequant+cuBLAS"] += bench(lambda: F.linear(x, wq_gemm.dequantize(*packed, dtype=torch.bfloat16)))
                for name, cfg in (SKINNY_CONFIGS.items() if skinny_sweep and r <= wq_gemm.MAX_SKINNY_ROWS else ()):
                    cfg = {**cfg, "BLOCK_M": max(16, triton.next_power_of_2(r))}
                    sk_tiles[r][name] = sk_tiles[r].get(name, 0.0) + bench(
                        lambda cfg=cfg: wq_gemm.wq_mm(x, *packed, config=cfg))
                for name, cfg in (WX_CONFIGS.items() if r >= 32 else ()):
                    wx_tiles[r][name] = wx_tiles[r].get(name, 0.0) + bench(
                        lambda cfg=cfg: wq_gemm.wq_mm_wx(x, *packed, config=cfg))
        for r in rows_measured:  # the weight-left GEMM's best tile over the four shapes together
            times[r]["weight-left"] = min(wx_tiles[r].values(), default=math.inf)
        rows_out = {}
        TABLE.append(f"dispatch {fmt}: one layer's qkv+o+gate_up+down, microseconds "
                     f"(bf16 | skinny | tiled | dequant+cuBLAS | weight-left, best tile | best | rule | rule / bf16)")
        for r in rows_measured:
            t = times[r]
            quant = {k: v for k, v in t.items() if k != "bf16"}
            best = min(quant, key=quant.get)
            rule = rule_choice(r, kernel, fmt != "int8")
            rows_out[r] = {**{k: v * 1e6 for k, v in t.items()}, "best": best, "rule": rule,
                           "rule_vs_bf16": t["bf16"] / t[rule],
                           "weight_left_tiles_us": {k: v * 1e6 for k, v in wx_tiles[r].items()},
                           "skinny_tiles_us": {k: v * 1e6 for k, v in sk_tiles[r].items()}}
            if sk_tiles[r]:
                name = min(sk_tiles[r], key=sk_tiles[r].get)
                TABLE.append(f"  rows {r:5d}: skinny tiles, best {name}: {sk_tiles[r][name] * 1e6:.1f} us "
                             f"(default {t['skinny'] * 1e6:.1f})")
            cells = " | ".join(f"{t[k] * 1e6:8.1f}" if t[k] < math.inf else "       -" for k in t)
            TABLE.append(f"  rows {r:5d}: {cells} | {best:14s} | {rule:14s} | {t['bf16'] / t[rule]:.2f}x faster")
        skinny_max = max((r for r in rows_measured if rows_out[r]["best"] == "skinny"), default=0)
        deq_min = min((r for r in rows_measured if r > skinny_max and rows_out[r]["best"] == "dequant+cuBLAS"),
                      default=None)
        out[fmt] = {"rows": rows_out, "implied_wq_skinny_max_rows": skinny_max, "implied_wq_dequant_min_rows": deq_min}
        TABLE.append(f"  measured rule: skinny up to {skinny_max} rows, dequant+cuBLAS from {deq_min} "
                     f"(KernelConfig: {kernel.wq_skinny_max_rows}, {kernel.wq_dequant_min_rows})")
        print("\n".join(TABLE[-len(rows_measured) - 2:]), flush=True)
        torch.cuda.empty_cache()
    return out


def copies_past_l2(w: torch.Tensor, int4: bool) -> tuple[list[tuple], list[torch.Tensor]]:
    """Copies of ``w`` packed (int4 in groups of 128, or int8 per channel: wq_gemm's argument
    tuples) and of ``w`` itself, each list at most 16 long and together twice the L2 cache, so
    that products timed over them read their weights from memory, as 32 layers' do."""
    from kvserve.layers.rtn import quantize_int4, quantize_int8
    packed = (*quantize_int4(w, 128, w.dtype), 128) if int4 else (*quantize_int8(w, w.dtype), None, 0)
    l2 = 2 * torch.cuda.get_device_properties(0).L2_cache_size
    size = sum(t.numel() * t.element_size() for t in packed if isinstance(t, torch.Tensor))
    packs = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in packed)
             for _ in range(min(16, -(-l2 // size)))]
    dense = [w.clone() for _ in range(min(16, -(-l2 // (w.numel() * w.element_size()))))]
    return packs, dense


@section("split")
def run_split(rows_measured: list[int]):
    """Each projection at each row count through the product the engine's rule picks (skinny,
    tiled or weight-left, at its default tile), its K summed in 1, 2, 4 or 8 parts, against bf16
    and the parts ``wq_gemm.split_k`` chooses: microseconds per projection (ten in a CUDA graph)
    and per layer."""
    import torch.nn.functional as F

    from kvserve.kernels import wq_gemm
    from kvserve.kernels.gemv import MAX_ROWS, gemv
    kernel = KernelConfig(wq_s8_min_rows=0)  # the products that split K: the rule without s8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for fmt in ("int8", "int4-g128"):
        int4 = fmt != "int8"
        res = {r: {} for r in rows_measured}
        for shape, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            packs, dense = copies_past_l2(w, int4)
            for r in rows_measured:
                how = cuda_product(r, kernel, int4, wide=True)
                if how == "dequant" or r == 1:
                    continue
                x = torch.randn(r, K, device="cuda", generator=gen, dtype=torch.bfloat16)
                if how == "weight-left":
                    cfg = wq_gemm.wx_config(r)
                    tiles = triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(r, cfg["BLOCK_M"])
                    k_tiles = K // wq_gemm.WX_BLOCK_K
                    product = wq_gemm.wq_mm_wx
                else:
                    cfg = wq_gemm.default_config(r if how == "skinny" else wq_gemm.MAX_SKINNY_ROWS + 1, N, K, int4)
                    tiles = triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(r, cfg["BLOCK_M"])
                    k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
                    product = wq_gemm.wq_mm

                # In a CUDA graph, as the engine's steps run (the host time of the launches,
                # which a second kernel doubles, is not the GPU's), over copies of the weight
                # that together outgrow L2, as 32 layers' weights do.
                def run(parts, product=product, cfg=cfg):
                    for p in packs:
                        product(x, *p, config={**cfg, "SPLIT_K": parts})
                times = {p: graph_time(lambda p=p: run(p)) / len(packs) * 1e6 for p in (1, 2, 4, 8)}
                bf16 = graph_time(lambda: [F.linear(x, v) for v in dense]) / len(dense)
                if r <= MAX_ROWS:
                    bf16 = min(bf16, graph_time(lambda: [gemv(x, v) for v in dense]) / len(dense))
                res[r][shape] = {"product": how, "tiles": tiles, "k_tiles": k_tiles, "bf16": bf16 * 1e6,
                                 "parts_us": times,
                                 "rule_parts": wq_gemm.split_k(tiles, k_tiles, sms, r, int4)}
            packs = dense = None  # (freed before the next shape's)
        TABLE.append(f"split {fmt}: rows | projection | product | tiles | bf16 us | K in 1 / 2 / 4 / 8 parts, us | "
                     f"rule's parts")
        for r in rows_measured:
            for shape, d in res[r].items():
                cells = " / ".join(f"{d['parts_us'][p]:6.1f}" for p in (1, 2, 4, 8))
                TABLE.append(f"  {r:4d} | {shape:7s} | {d['product']:11s} | {d['tiles']:4d} | {d['bf16']:6.1f} | "
                             f"{cells} | {d['rule_parts']}")
            if res[r]:
                one = sum(d["parts_us"][1] for d in res[r].values())
                rule = sum(d["parts_us"][d["rule_parts"]] for d in res[r].values())
                best = sum(min(d["parts_us"].values()) for d in res[r].values())
                bf = sum(d["bf16"] for d in res[r].values())
                TABLE.append(f"  {r:4d} | layer   | bf16 {bf:6.1f} | one part {one:6.1f} | rule {rule:6.1f} "
                             f"({bf / rule:.2f}x bf16) | best {best:6.1f}")
        out[fmt] = {str(r): v for r, v in res.items()}
        print("\n".join(TABLE[-(len(rows_measured) * 5 + 1):]), flush=True)
        torch.cuda.empty_cache()
    return out


# The weight-left GEMM's tiles (BLOCK_N weight rows, BLOCK_M rows of x, BLOCK_K columns a step).
WX_CONFIGS = {f"{bn}x{bm}x{bk} w{nw} s{ns}": {"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": nw,
                                             "num_stages": ns}
              for bn, bm, bk, nw, ns in [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
                                         (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (256, 128, 64, 8, 3),
                                         (128, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
                                         (64, 256, 128, 8, 3), (64, 128, 128, 4, 3)]}
# The skinny shape's tiles (BLOCK_N weight rows, BLOCK_K columns a step; x padded to 16 or 32 rows).
SKINNY_CONFIGS = {f"{bn}x{bk} w{nw} s{ns}": {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
                  for bn, bk, nw, ns in [(64, 256, 4, 3), (32, 256, 4, 3), (16, 256, 4, 3), (32, 512, 4, 3),
                                         (16, 512, 4, 3), (32, 128, 4, 4), (16, 128, 2, 4), (32, 256, 2, 3)]}
STEP_CONFIGS = ([{"KIND": "triton", "BLOCK_N": 4, "TILE_BYTES": 1024, "PREFETCH": 1, "num_warps": 4}] +
                [{"KIND": "gluon", "BLOCK_N": bn, "PREFETCH": pf, "num_warps": nw}
                 for bn, pf, nw in [(4, 1, 4), (8, 1, 4), (8, 2, 4), (4, 2, 2), (8, 1, 2), (16, 1, 4)]])
# The integer tensor-core product's tiles (int4: the column step is the group).
S8_CONFIGS = {f"{bn}x{bm}x{bk} w{nw} s{ns}": {"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": nw,
                                             "num_stages": ns}
              for bn, bm, bk, nw, ns in [(64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (128, 128, 128, 8, 3),
                                         (64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 128, 8, 3),
                                         (64, 256, 64, 8, 3)]}
GENERIC_ONE_ROW = {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}


def graph_time(launch, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of ``launch`` (kernels back to back, as the
    engine's captured decode step runs them)."""
    import statistics
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()
        launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


@section("step")
def run_step(sweep: bool, formats: tuple[str, ...] = ("int8", "int4-g128", "int4-g32", "int8-g32"),
             per_shape: bool = False):
    """The decoder projections of one batch-1 step of the Llama-3-8B shape: 32 layers of qkv, o,
    gate/up and down, each layer its own weights, launched back to back in one CUDA graph. bf16
    (the skinny kernel) against each packed format, with the generic one-row tile of
    ``wq_gemm`` and the word kernel of ``wq_gemv`` (its default tile, or every tile of
    ``STEP_CONFIGS`` with ``--step-sweep``): microseconds a step, weight bytes read per second."""
    from kvserve.kernels import wq_gemm
    from kvserve.kernels.gemv import gemv
    from kvserve.layers.rtn import quantize_int4, quantize_int8
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = {K: torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen) for _, K in SHAPES.values()}
    dense = [[torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
              for N, K in SHAPES.values()] for _ in range(32)]

    def pack(w, fmt):
        if fmt == "int8":
            return (*quantize_int8(w, torch.bfloat16), None, 0)
        if fmt.startswith("int8-g"):  # group-wise int8, as GGUF's Q8_0 repacks
            g = int(fmt.removeprefix("int8-g"))
            s = w.view(w.shape[0], -1, g).abs().amax(2).clamp_min(1e-8) / 127
            q = (w.view(w.shape[0], -1, g) / s[..., None]).round().to(torch.int8).view(w.shape)
            return q, s.to(torch.bfloat16), None, g
        g = int(fmt.removeprefix("int4-g"))
        return (*quantize_int4(w, g, torch.bfloat16), g)

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for layer in ts for p in layer for t in
                   (p if isinstance(p, tuple) else (p,)) if isinstance(t, torch.Tensor))

    out = {}
    t = graph_time(lambda: [gemv(xs[w.shape[1]], w) for layer in dense for w in layer])
    out["bf16"] = {"us": t * 1e6, "tb_s": nbytes(dense) / t / 1e12}
    TABLE.append("one step's projections, 32 layers in a graph: format | config | us | weight TB/s | x bf16")
    TABLE.append(f"  bf16       | gemv default | {t * 1e6:7.1f} | {out['bf16']['tb_s']:.2f} |")
    for fmt in formats:
        packed = [[pack(w, fmt) for w in layer] for layer in dense]
        size = nbytes(packed)
        configs = [("generic", GENERIC_ONE_ROW), ("default", None)]
        if sweep:
            configs += [(f"{c['KIND']} {c['BLOCK_N']}x{c.get('TILE_BYTES', '')} p{c['PREFETCH']} w{c['num_warps']}", c)
                        for c in STEP_CONFIGS]
        res = {}
        int4 = fmt.startswith("int4")
        for name, cfg in configs:
            def launch(cfg=cfg, packed=packed):
                for layer in packed:
                    for p in layer:
                        wq_gemm.wq_mm(xs[p[0].shape[1] * (2 if int4 else 1)], *p, config=cfg)
            try:
                t = graph_time(launch)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is a row
                res[name] = {"error": repr(e)[:200]}
                TABLE.append(f"  {fmt:10s} | {name:18s} | FAILED {e!r}"[:160])
                continue
            res[name] = {"us": t * 1e6, "tb_s": size / t / 1e12, "x_bf16": out["bf16"]["us"] / (t * 1e6),
                         "config": cfg}
            shapes = ""
            if per_shape:  # each projection alone: its 32 layers in one graph
                for i, shape in enumerate(SHAPES):
                    def one(cfg=cfg, packed=packed, i=i):
                        for layer in packed:
                            p = layer[i]
                            wq_gemm.wq_mm(xs[p[0].shape[1] * (2 if int4 else 1)], *p, config=cfg)
                    res[name][f"{shape}_us"] = graph_time(one) * 1e6 / 32
                shapes = " | " + " ".join(f"{k}={res[name][f'{k}_us']:.2f}" for k in SHAPES)
            TABLE.append(f"  {fmt:10s} | {name:18s} | {t * 1e6:7.1f} | {size / t / 1e12:.2f} | "
                         f"{out['bf16']['us'] / (t * 1e6):.2f}x{shapes}")
        ok = {k: v for k, v in res.items() if "us" in v}
        best = min(ok, key=lambda k: ok[k]["us"])
        out[fmt] = {"weight_bytes": size, "configs": res, "best": best}
        TABLE.append(f"  {fmt:10s} | best: {best} ({ok[best]['us']:.1f} us)")
        print("\n".join(TABLE[-len(configs) - 1:]), flush=True)
        del packed
        torch.cuda.empty_cache()
    return out


def weight_bytes(llm) -> int:
    """Bytes a decode step reads of the weights: every parameter and buffer but the embedding
    table and RoPE's cos/sin tables."""
    m = llm.engine.runner.model
    total = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    total -= sum(b.numel() * b.element_size() for b in m.rope.buffers())
    return total - m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()


def random_gguf_rows(qtype: str, N: int, K: int, device: str) -> torch.Tensor:
    """[N, bytes per row] of valid random ``qtype`` blocks (any byte is a valid code or 6-bit
    scale; the float16 scales are set)."""
    from kvserve.layers.gguf_blocks import FORMATS
    cols, nbytes = FORMATS[qtype][:2]
    raw = torch.randint(0, 256, (N, K // cols, nbytes), dtype=torch.uint8, device=device)
    d = torch.full((N, K // cols, 1), _GGUF_D[qtype], dtype=torch.float16, device=device)
    raw[..., 0:2] = d.view(torch.uint8)
    if qtype == "Q4_K":
        raw[..., 2:4] = (d * 7.5).view(torch.uint8)
    return raw.view(N, -1)


def pack_as_gguf(llm, qtype: str) -> None:
    """Replace the dummy model's projections by random ``qtype`` blocks kept packed, then capture
    the decode graphs again (they hold the old weights)."""
    from kvserve.layers.quant_linear import QUANTIZED_LAYERS, QuantLinear
    rt = llm.engine.runner
    for name, mod in list(rt.model.named_modules()):
        if name.rsplit(".", 1)[-1] in QUANTIZED_LAYERS:
            raw = random_gguf_rows(qtype, mod.out_features, mod.in_features, "cuda")
            parent, _, attr = name.rpartition(".")
            setattr(rt.model.get_submodule(parent), attr, QuantLinear.from_gguf(qtype, raw, mod.in_features))
    if rt.graphs is not None:
        rt.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        rt.capture_graphs()


@section("s8")
def run_s8(rows_measured: list[int]):
    """Each projection at each row count on the integer tensor cores (``wq_s8.wq_mm_s8``, every
    tile of S8_CONFIGS, K split as the rule says), against bf16 cuBLAS and the product the
    default rule picks, all in CUDA graphs over copies of the weight that together outgrow L2;
    microseconds per projection and per layer (qkv + o + gate/up + down)."""
    import torch.nn.functional as F

    from kvserve.kernels import wq_s8
    kernel = KernelConfig(wq_s8_min_rows=0)  # s8 against the rule's other products
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for fmt in ("int8", "int4-g128"):
        int4 = fmt != "int8"
        res = {r: {} for r in rows_measured}
        for shape, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            packs, dense = copies_past_l2(w, int4)
            for r in rows_measured:
                x = torch.randn(r, K, device="cuda", generator=gen, dtype=torch.bfloat16)
                how = cuda_product(r, kernel, int4, wide=True)
                d = {"rule": how, "bf16": graph_time(lambda: [F.linear(x, v) for v in dense]) / len(dense) * 1e6,
                     "rule_us": graph_time(lambda how=how: [run_cuda_product(how, x, *p, None, kernel)
                                                            for p in packs]) / len(packs) * 1e6, "s8_us": {}}
                for name, cfg in S8_CONFIGS.items():
                    try:
                        d["s8_us"][name] = graph_time(
                            lambda cfg=cfg: [wq_s8.wq_mm_s8(x, *p, config=cfg) for p in packs]) / len(packs) * 1e6
                    except Exception as e:  # a tile past the SM's shared memory or registers
                        d["s8_us"][name] = math.inf
                        print(f"s8 {fmt} {shape} {r} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                res[r][shape] = d
            packs = dense = None
        TABLE.append(f"s8 {fmt}: rows | layer us: bf16 | the rule's product | s8 at its best tile (tile) | "
                     f"s8 at the default tile | best / bf16")
        for r in rows_measured:
            bf = sum(d["bf16"] for d in res[r].values())
            ru = sum(d["rule_us"] for d in res[r].values())
            tiles = {n: sum(d["s8_us"][n] for d in res[r].values()) for n in S8_CONFIGS}
            best = min(tiles, key=tiles.get)
            dflt = wq_s8.s8_config(r)
            dname = f"{dflt['BLOCK_N']}x{dflt['BLOCK_M']}x{dflt['BLOCK_K']} w{dflt['num_warps']} s{dflt['num_stages']}"
            TABLE.append(f"  {r:5d} | {bf:7.1f} | {ru:7.1f} ({res[r]['qkv']['rule']}) | {tiles[best]:7.1f} ({best}) | "
                         f"{tiles.get(dname, math.inf):7.1f} | {bf / tiles[best]:.2f}x")
        out[fmt] = {str(r): v for r, v in res.items()}
        print("\n".join(TABLE[-(len(rows_measured) + 1):]), flush=True)
        torch.cuda.empty_cache()
    return out


@section("engine")
def run_engine(n_req: int, formats: list[str], weight_left_max_rows: int, kv_cache_memory: str | None = "40GiB",
               max_num_seqs: int = 256, s8_rows: tuple[int, int] = (64, 512)):
    """Batch-1 decode and offline throughput per format. ``kv_cache_memory`` None: the pool sized
    from the memory the weights leave (the engine's default), so a smaller format holds more
    sequences at once (with ``max_num_seqs`` raised to let it)."""
    from kvserve.bench.quality import teacher_forced_agreement
    run_requests = gpu_check.run_requests
    out = {}
    rng = random.Random(7)
    decode_prompt = [rng.randrange(128000) for _ in range(512)]
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(128, 1024))] for _ in range(n_req)]
    for name in formats:
        fmt, *opts = name.split("+")
        kw, kernel = dict(GPU_FORMATS[fmt]), {}
        for opt in opts:
            if opt == "noreserve":  # admission keeps no room for decoding (preempts when dry)
                kw["decode_reserve"] = 0
            elif opt == "nosplit":
                kernel["wq_split_k"] = False
            elif opt in ("silu", "nosilu"):  # the one-row gate/up product's activation fused or not
                kernel["wq_fused_silu"] = opt == "silu"
            elif opt == "wl":
                kernel["wq_weight_left_max_rows"] = weight_left_max_rows
            elif opt == "s8":
                kernel.update(wq_s8_min_rows=s8_rows[0], wq_s8_max_rows=s8_rows[1])
            elif opt == "nos8":
                kernel["wq_s8_min_rows"] = 0
            elif opt == "int8head":  # the output head in int8 (bf16 by default)
                kw["quantization_head"] = "int8"
            elif opt == "deq":  # the dispatch before the weight-left GEMM was on
                kernel.update(wq_skinny_max_rows=16, wq_dequant_min_rows=64, wq_weight_left_max_rows=0)
            else:
                raise SystemExit(f"--formats: unknown option +{opt} in {name}")
        if kernel:
            kw["kernel"] = KernelConfig(**kernel)
        t0 = time.perf_counter()
        llm = LLM("dummy:llama-3-8b", dtype="bfloat16", kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=8192, max_model_len=2048, show_progress=False, **kw)
        if fmt.startswith("gguf-"):
            pack_as_gguf(llm, fmt.removeprefix("gguf-"))
        start = time.perf_counter() - t0
        wb = weight_bytes(llm)
        run_requests(llm, [decode_prompt[:64]], 4)  # warm
        r = run_requests(llm, [decode_prompt], 256)
        tps = 255 / r["decode_seconds"]
        # the decode steps (graphs, few-row kernels) against one prefill of prompt + output (eager,
        # the large-batch path): the share of steps whose greedy token the prefill ranks first
        agree = teacher_forced_agreement(llm, [decode_prompt], [r["tokens"][0]])
        out[name] = {"weight_gib": wb / 2**30, "decode_tok_s": tps, "graphs_vs_prefill_top1": agree,
                     "decode_weight_tb_s": wb * tps / 1e12, "startup_seconds": start}
        if n_req:  # (--requests 0: batch-1 decode only)
            run_requests(llm, prompts[:32], 8)  # warm
            off = run_requests(llm, prompts, 256)
            out[name].update(offline_seconds=off["seconds"], offline_out_tok_s=off["output_tokens"] / off["seconds"],
                             offline_steps=off["steps"], offline_preemptions=off["preemptions"],
                             # prompt tokens computed over those in the prompts: > 1 where preempted
                             # requests computed theirs again
                             offline_prefill_ratio=off["prompt_tokens_computed"] / sum(map(len, prompts)),
                             kv_blocks=llm.engine.kv.pool.num_blocks)
        print(f"engine {name}: {out[name]}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = out.get("bf16") or next(iter(out.values()))  # ratios to bf16 where it ran, else to the first
    TABLE.append("kvserve, Llama-3-8B shape: format | weights GiB | batch-1 decode tok/s (x bf16) | "
                 f"offline {n_req} req out tok/s (x bf16) | decode tokens = prefill's top-1")
    for name, r in out.items():
        off = (f"{r['offline_out_tok_s']:7.0f} ({r['offline_out_tok_s'] / base['offline_out_tok_s']:.2f}x)"
               if n_req else "-")
        TABLE.append(f"  {name:10s} | {r['weight_gib']:5.2f} | {r['decode_tok_s']:7.1f} "
                     f"({r['decode_tok_s'] / base['decode_tok_s']:.2f}x) | {off} | {r['graphs_vs_prefill_top1']:.1%}")
    return out


def gemm_ceiling(dtype: str, n: int = 8192) -> float:
    """FLOP/s of a dense n^3 product on this GPU: bf16 through torch.matmul, fp8 through
    torch._scaled_mm with a scale per row of each operand and bf16 out, as an FP8 layer runs it."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if dtype == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
        t = bench(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    else:
        t = bench(lambda: a @ b)
    return 2 * n ** 3 / t


@section("prefill")
def run_prefill(formats: list[str]):
    """One 8,192-token prompt's prefill per format (the median of three, each a fresh prompt: no
    prefix-cache hits), its model FLOPs (every token through the decoder layers, causal
    attention, the last row through the head) per second, and that over the same run's dense
    GEMM ceilings: bf16's, and FP8's for the fp8 format (W8A8)."""
    run_requests = gpu_check.run_requests
    ceil = {"bf16": gemm_ceiling("bf16"), "fp8": gemm_ceiling("fp8")}
    TABLE.append(f"dense GEMM ceilings, 8192^3: bf16 {ceil['bf16'] / 1e12:.0f} TFLOP/s, "
                 f"fp8 {ceil['fp8'] / 1e12:.0f} TFLOP/s")
    out = {"ceilings_tflops": {k: v / 1e12 for k, v in ceil.items()}}
    T = 8192
    rng = random.Random(3)
    for name in formats:
        llm = LLM("dummy:llama-3-8b", dtype="bfloat16", kv_cache_memory="16GiB", max_num_seqs=16,
                  max_num_batched_tokens=T, max_model_len=T + 16, show_progress=False, **GPU_FORMATS[name])
        a = llm.engine.arch
        per_layer = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim \
            + a.num_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
        flops = (2 * a.num_layers * per_layer * T + 2 * a.vocab_size * a.hidden_size
                 + 2 * 2 * a.num_layers * a.num_heads * a.head_dim * T * T / 2)
        fresh = lambda: [rng.randrange(128000) for _ in range(T)]  # noqa: E731
        run_requests(llm, [fresh()], 1)  # warm
        t = sorted(run_requests(llm, [fresh()], 1)["seconds"] for _ in range(3))[1]
        peak = ceil["fp8" if name == "fp8" else "bf16"]
        out[name] = {"seconds": t, "tflops": flops / t / 1e12, "of_ceiling": flops / t / peak,
                     "of_bf16_ceiling": flops / t / ceil["bf16"]}
        print(f"prefill {name}: {out[name]}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = out.get("bf16")
    TABLE.append("prefill, one 8,192-token prompt: format | ms | TFLOP/s | of its GEMM ceiling | x bf16's time")
    for name in formats:
        r = out[name]
        TABLE.append(f"  {name:10s} | {r['seconds'] * 1e3:6.1f} | {r['tflops']:5.0f} | {r['of_ceiling']:.1%} | "
                     + (f"{base['seconds'] / r['seconds']:.2f}x" if base else "-"))
    return out


@section("peer")
def run_peer():
    from benchmarks.weight_quant_peer import decode_tok_s
    cfg = DUMMY_PRESETS["llama-3-8b"]
    out = {}
    for mode in ("bf16", "int8", "int4"):
        try:
            out[mode] = decode_tok_s(cfg, mode)
        except Exception as e:  # one form failing (an op missing on this build) leaves the others
            out[mode] = {"error": repr(e)[:300]}
        print(f"peer {mode}: {out[mode]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    TABLE.append("PyTorch weight-only (gpt-fast style, torch.compile): format | batch-1 decode tok/s | layer error")
    for mode, r in out.items():
        if "error" in r:
            TABLE.append(f"  {mode:10s} | FAILED {r['error'][:100]}")
        else:
            TABLE.append(f"  {mode:10s} | {r['tok_s']:7.1f} | {r['layer_rel_err']:.1e}")
    return out


@section("cpu")
def run_cpu(new_tokens: int, quality_tokens: int, reps: int, formats: list[str]):
    from kvserve.bench.quality import heldout_ids, perplexity
    out = {}
    ids = None
    for name in ["fp32"] + [f for f in formats if f != "fp32"]:  # the reference first
        kw = CPU_FORMATS[name]
        llm = LLM(show_progress=False, max_model_len=2048, dtype="float32", **kw)  # the activations' dtype
        if ids is None:
            ids = heldout_ids(llm.get_tokenizer(), quality_tokens)
        prompt = {"prompt_token_ids": ids[:32]}
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
        best = math.inf
        for _ in range(reps):  # the best of several: the CPU is shared
            t0 = time.perf_counter()
            o = llm.generate([prompt], params, use_tqdm=False)[0]
            best = min(best, time.perf_counter() - t0)
        ppl = perplexity(llm, ids)
        out[name] = {"tok_s": len(o.outputs[0].token_ids) / best, "perplexity": ppl}
        print(f"cpu {name}: {out[name]}", flush=True)
        del llm
        gc.collect()
    base = out["fp32"]
    TABLE.append(f"CPU, SmolLM2-135M, {torch.get_num_threads()} threads: format | batch-1 tok/s (x fp32) | "
                 f"perplexity over {len(ids)} tokens (vs fp32)")
    for name, r in out.items():
        TABLE.append(f"  {name:10s} | {r['tok_s']:6.1f} ({r['tok_s'] / base['tok_s']:.2f}x) | {r['perplexity']:.3f} "
                     f"({r['perplexity'] / base['perplexity'] - 1:+.2%})")
    return out


@section("s8-quality")
def run_s8_quality(quality_tokens: int):
    """What the s8 product's split of x costs in quality: each format's perplexity over the
    held-out text as it is, then with every many-row product's input rounded to the split's
    16-bit codes and back (the prompt is one prefill, so every product sees many rows), and
    rounded instead to one int8 code per value (a scale per row, max |x| / 127): what a single
    int8 product of x, twice the split's speed, would cost."""
    from kvserve.bench.quality import heldout_ids, perplexity
    from kvserve.kernels.wq_s8 import split_rows_ref
    from kvserve.layers import quant_linear
    plain = quant_linear.QuantLinear._cpu

    def rounded(self, x):
        if x.shape[0] > 1:
            q, s, _ = split_rows_ref(x)
            hi, lo = q.float()
            x = ((256 * hi + lo) * s[:, None]).to(x.dtype)
        return plain(self, x)

    def one_int8(self, x):
        if x.shape[0] > 1:
            xf = x.float()
            s = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
            x = (torch.round(xf / s) * s).to(x.dtype)
        return plain(self, x)
    out = {}
    TABLE.append(f"s8-quality, CPU, SmolLM2-135M in float32: format | perplexity over {quality_tokens} tokens | "
                 f"with x split (change) | with x in one int8 code (change)")
    for name in ("int8", "int4-g32"):
        llm = LLM(show_progress=False, max_model_len=quality_tokens + 16, dtype="float32", **CPU_FORMATS[name])
        ids = heldout_ids(llm.get_tokenizer(), quality_tokens)
        r = {"plain": perplexity(llm, ids)}
        for key, product in (("split", rounded), ("one_int8", one_int8)):
            quant_linear.QuantLinear._cpu = product
            try:
                r[key] = perplexity(llm, ids)
            finally:
                quant_linear.QuantLinear._cpu = plain
        out[name] = r
        TABLE.append(f"  {name:8s} | {r['plain']:.4f} | {r['split']:.4f} ({r['split'] / r['plain'] - 1:+.4%}) | "
                     f"{r['one_int8']:.4f} ({r['one_int8'] / r['plain'] - 1:+.4%})")
        print(TABLE[-1], flush=True)
        del llm
        gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="sections, comma-separated (default: the device's)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="40GiB",
                    help="engine section: the KV pool, or 'auto' to size it from the memory the weights leave")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine section: sequences a step at most")
    ap.add_argument("--step-sweep", action="store_true", help="step section: time every tile of STEP_CONFIGS")
    ap.add_argument("--step-formats", default="int8,int4-g128,int4-g32,int8-g32",
                    help="step section: packed formats, comma-separated")
    ap.add_argument("--step-per-shape", action="store_true",
                    help="step section: also time each projection alone (us a layer)")
    ap.add_argument("--skinny-sweep", action="store_true", help="dispatch section: time SKINNY_CONFIGS' tiles")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="dispatch section: row counts, comma-separated")
    ap.add_argument("--formats", default=",".join(GPU_FORMATS),
                    help="engine section: formats, comma-separated (bf16 first: the peer); a weight-only "
                         "format with +wl takes its large products by the weight-left GEMM")
    ap.add_argument("--weight-left-max-rows", type=int, default=1 << 20,
                    help="+wl formats: the most rows a product takes the weight-left GEMM")
    ap.add_argument("--s8-min-rows", type=int, default=64,
                    help="+s8 formats: the fewest rows a product takes the integer tensor cores")
    ap.add_argument("--s8-max-rows", type=int, default=512,
                    help="+s8 formats: the most rows a product takes the integer tensor cores")
    ap.add_argument("--cpu-new-tokens", type=int, default=64)
    ap.add_argument("--quality-tokens", type=int, default=1024)
    ap.add_argument("--cpu-reps", type=int, default=3, help="timed generations per format (the best counts)")
    ap.add_argument("--cpu-formats", default=",".join(CPU_FORMATS),
                    help=f"CPU formats, comma-separated (fp32 always runs): {', '.join(CPU_FORMATS)}")
    args = ap.parse_args()
    step_formats = {"int8", *(f"int8-g{g}" for g in (16, 32, 64, 128)), *(f"int4-g{g}" for g in (32, 64, 128))}
    for fmt in args.step_formats.split(","):
        if fmt not in step_formats:
            raise SystemExit(f"--step-formats: {fmt!r} is not one of {', '.join(sorted(step_formats))}")
    gpu_check.OUT_PATH = os.path.join(args.out, f"weight_quant_{args.device}.json")
    only = set((args.only or ("tests,step,dispatch,engine,peer" if args.device == "cuda" else "cpu")).split(","))
    RESULTS["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    sections = {"tests": run_tests,
                "step": lambda: run_step(args.step_sweep, tuple(args.step_formats.split(",")), args.step_per_shape),
                "dispatch": lambda: run_dispatch([int(r) for r in args.rows.split(",")], args.skinny_sweep),
                "engine": lambda: run_engine(args.requests, args.formats.split(","), args.weight_left_max_rows,
                                             None if args.kv_cache_memory == "auto" else args.kv_cache_memory,
                                             args.max_num_seqs, (args.s8_min_rows, args.s8_max_rows)),
                "split": lambda: run_split([int(r) for r in args.rows.split(",")]),
                "s8": lambda: run_s8([int(r) for r in args.rows.split(",")]),
                "prefill": lambda: run_prefill(args.formats.split(",")),
                "peer": run_peer,
                "s8-quality": lambda: run_s8_quality(args.quality_tokens),
                "cpu": lambda: run_cpu(args.cpu_new_tokens, args.quality_tokens, args.cpu_reps,
                                       args.cpu_formats.split(","))}
    for name, run in sections.items():
        if name in only:
            run()
            # the table so far after every section: a run cut short still ends in one
            print("\n" + "\n".join(TABLE), flush=True)


if __name__ == "__main__":
    main()
