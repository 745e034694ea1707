"""Compressed KV cache on the GPU (fp8 / int8 / int4 / int2 KV), Llama-3-8B shape, dummy bf16
weights. One run:

    PYTHONPATH=$PWD python benchmarks/kv_compression.py --out $OUT

Sections (JSON saved after each, a table printed last):

* ``tests``    - the KV-quantization kernel tests (and the other kernel tests) at CUDA sizes;
* ``capacity`` - 4,096-token sequences that fit a 40 GiB KV budget per format, by the engine's
  own accounting (blocks with their scales, plus KIVI's per-sequence key residual), then that
  many sequences' cache really allocated on the GPU;
* ``kernel``   - one layer's paged decode attention at batch 32 x 32k context (GQA 32/8), each
  format against bf16, on caches filled by the quantizing writer;
* ``decode``   - the whole engine's decode step (CUDA graphs, sampling excluded) at batch 32 x
  32k context per format against bf16 KV. bf16 KV for 32 x 32k tokens of all 32 layers is 128
  GiB and does not fit one H200 beside the weights, so this runs a 16-layer model of the
  Llama-3-8B layer shape (identical layers; the ratio per layer is what changes with the
  format). Contexts are block tables over the cache as written (no prefill is timed);
* ``offline``  - the offline benchmark (256 requests, prompts 128-1024, 256 new tokens) with
  fp8 KV and with bf16 KV in the same run.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_check import RESULTS, TABLE, section  # noqa: E402  (sections, JSON after each)
from kvserve import LLM  # noqa: E402
from kvserve import kv_format as kf  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402
from kvserve.models.presets import DUMMY_PRESETS  # noqa: E402

FORMATS = ["auto", "fp8", "int8", "int4", "int2"]
GiB = 2**30


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run of the script


def bench(fn) -> float:
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3


def arch_8b():
    from kvserve.models.arch import ModelArch
    return ModelArch.from_hf_config(DUMMY_PRESETS["llama-3-8b"], "llama-3-8b")


@section("tests")
def run_tests(paths):
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                       capture_output=True, text=True)
    lines = (p.stdout + p.stderr).strip().splitlines()
    tail = lines[-3:]
    print("\n".join(lines[-60:] if p.returncode else tail))
    TABLE.append(f"tests: {tail[-1] if tail else '?'} (rc {p.returncode})")
    return {"rc": p.returncode, "tail": tail}


@section("capacity")
def run_capacity(budget_gib: float = 40, seq_len: int = 4096):
    if DEV == "cpu":
        budget_gib = 0.5  # smoke
    a = arch_8b()
    budget = int(budget_gib * GiB)
    out, base = {}, None
    for name in FORMATS:
        bs = kf.default_block_size(name)
        f = kf.KVFormat(name, a.num_kv_heads, a.head_dim, bs, torch.bfloat16)
        per_seq = a.num_layers * f.block_bytes * math.ceil(seq_len / bs)
        row = a.num_layers * f.residual_bytes(1)  # KIVI: one residual row per running sequence
        n = (budget - row) // (per_seq + row)
        # really allocate that cache (and check what it took)
        from kvserve.engine.kv_cache import KVCache
        before = torch.cuda.memory_allocated() if DEV == "cuda" else 0
        kv = KVCache(a, n * math.ceil(seq_len / bs), bs, torch.bfloat16, torch.device(DEV), fmt=f,
                     residual_slots=n + 1 if f.kivi else 0)
        used = (torch.cuda.memory_allocated() - before) if DEV == "cuda" else kv.nbytes
        del kv
        torch.cuda.empty_cache()
        assert used <= budget, (name, used, budget)
        base = base or n
        bytes_tok_head = f.block_bytes / bs / a.num_kv_heads
        out[name] = {"sequences": n, "vs_bf16": n / base, "allocated_gib": used / GiB, "block_size": bs,
                     "bytes_per_token_head_kv": bytes_tok_head}
        line = (f"capacity {name:5s}: {n:4d} x {seq_len}-token sequences in {budget_gib:g} GiB "
                f"({n / base:.2f}x bf16; {bytes_tok_head:.0f} B per token-head K+V; allocated {used / GiB:.2f} GiB)")
        TABLE.append(line)
        print(line, flush=True)
    return out


def engine_decode(q, kc, vc, tables, seq_lens, scale, rs, kernel: KernelConfig = KernelConfig(), counters=None,
                  **launch):
    """A layer's decode attention over a cache as the engine launches it (the backend's
    ``triton_attention.ROUTES``): the Gluon kernel for the KIVI int4 caches it takes, else the
    Triton split kernel at the engine's splits. ``launch``: the Triton kernel's launch instead
    of its defaults (``splits``, ``block_n``, ...)."""
    from kvserve.kernels import kivi_decode
    from kvserve.kernels.decode_attention import decode_splits, paged_decode_attention
    from kvserve.layers.triton_attention import cache_kind
    if not launch and cache_kind(kc, q, "decode", kernel) == "kivi4":
        return kivi_decode.kivi4_decode(q, kc, tables, seq_lens, rs, scale, torch.empty_like(q),
                                        l2_ahead=kernel.kivi_l2_ahead, wave=kernel.kivi_wave)
    f = kc.fmt if isinstance(kc, kf.KVViews) else None
    kvh = f.num_kv_heads if f is not None else kc.shape[2]
    launch.setdefault("splits", decode_splits(f, q.shape[0], kvh, q.device))
    return paged_decode_attention(q, kc, vc, tables, seq_lens, scale, res_slots=rs, pdl=kernel.pdl,
                                  counters=counters, **launch)


def _fill(f: kf.KVFormat, batch: int, ctx: int, gen):
    """A compressed (or bf16) cache for ``batch`` sequences of ``ctx`` keys, written by the
    reference writer from random bf16 K/V with a few outlier channels."""
    bs, kvh, D = f.block_size, f.num_kv_heads, f.head_dim
    bps = math.ceil(ctx / bs)
    nb = batch * bps
    tables = torch.arange(nb, dtype=torch.int32, device=DEV).view(batch, bps)
    if not f.quantized:
        kc = torch.randn(nb, bs, kvh, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        return (kc, torch.randn_like(kc)), tables, None
    data = torch.zeros(nb, f.block_bytes, dtype=torch.uint8, device=DEV)
    res = torch.zeros(batch + 1, bs, kvh, D, device=DEV, dtype=torch.bfloat16) if f.kivi else None
    views = f.views(data, res)
    for b in range(batch):
        k = torch.randn(ctx, kvh, D, device=DEV, generator=gen)
        k[..., :4] *= 8
        v = torch.randn(ctx, kvh, D, device=DEV, generator=gen)
        k, v = k.bfloat16(), v.bfloat16()
        pos = torch.arange(ctx, device=DEV)
        slots = tables[b][pos // bs].long() * bs + pos % bs
        if f.kivi:
            kf.write_keys_kivi(views, k, 0, ctx, ctx, tables[b], b)
        kf.write_tokens(views, k, v, slots)
    views.raw = data
    return (views, None), tables, torch.arange(batch, dtype=torch.int32, device=DEV)


@section("kernel")
def run_kernel(batch: int = 32, ctx: int = 32768, formats=FORMATS):
    from kvserve.kernels.common import SplitCounters
    a = arch_8b()
    H, D = a.num_heads, a.head_dim
    counters = SplitCounters()
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    out, base = {}, None
    for name in formats:
        f = kf.KVFormat(name, a.num_kv_heads, D, kf.default_block_size(name), torch.bfloat16)
        (kc, vc), tables, rs = _fill(f, batch, ctx, gen)
        fn = lambda: engine_decode(q, kc, vc, tables, seq_lens, D ** -0.5, rs, counters=counters)  # noqa: E731, F821 (del'd after use)
        fn()
        t = bench(fn)
        nbytes = batch * ctx * f.block_bytes / f.block_size  # K+V codes and scales read
        base = base or t
        out[name] = {"seconds": t, "tb_s": nbytes / t / 1e12, "speedup_vs_bf16": base / t}
        line = (f"decode attention {name:5s} {batch}x{ctx // 1024}k: {t * 1e3:.3f} ms, {nbytes / t / 1e12:.2f} TB/s "
                f"of cache read, {base / t:.2f}x bf16")
        TABLE.append(line)
        print(line, flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    return out


@section("decode")
def run_decode(batch: int = 32, ctx: int = 32768, layers: int = 16, formats=FORMATS):
    cfg = dict(DUMMY_PRESETS["llama-3-8b"], num_hidden_layers=layers)
    DUMMY_PRESETS[f"llama-3-8b-{layers}l"] = cfg
    out, base = {}, None
    for name in formats:
        llm = LLM(f"dummy:llama-3-8b-{layers}l", device=DEV, dtype="bfloat16" if DEV == "cuda" else "float32",
                  kv_cache_dtype=name,
                  kv_cache_memory=f"{int(layers * 4.2 + 4)}GiB", max_num_seqs=batch, max_model_len=ctx + 64,
                  max_num_batched_tokens=2048, show_progress=False, enable_prefix_caching=False)
        rt = llm.engine.runner
        bs = llm.engine.block_size
        bps = math.ceil((ctx + 1) / bs)
        assert llm.engine.num_kv_blocks >= batch * bps, (name, llm.engine.num_kv_blocks, batch * bps)
        # fill the cache with finite values: random K/V through the writer for layer 0's format,
        # copied to every layer (what attention reads, not what it means, sets the time)
        gen = torch.Generator(device=DEV).manual_seed(1)
        f = rt.kv_format
        (lay0, v0), tables, rs = _fill(f, batch, ctx, gen)
        data = rt.kv_cache.data
        n = batch * math.ceil(ctx / bs)
        if f.quantized:
            data[:, 0, :n] = lay0.raw
            if f.kivi:
                rt.kv_cache.residual[:, :batch + 1] = lay0.residual
        else:
            data[:, 0, :n] = lay0
            data[:, 1, :n] = v0
        del lay0, v0
        torch.cuda.empty_cache()
        ids = [0] * batch
        seqs = [(ctx, 1, list(range(i * bps, (i + 1) * bps))) for i in range(batch)]
        res = list(range(batch)) if f.kivi else None

        def step():
            h, _ = rt._forward(ids, seqs, res)  # noqa: F821 (del'd after the loop's use)
            return h
        with torch.inference_mode():
            assert DEV == "cpu" or (rt.graphs is not None and rt.graphs.fits(batch, bps))
            step()
            t = bench(step)
        base = base or t
        out[name] = {"step_seconds": t, "tok_s": batch / t, "speedup_vs_bf16": base / t, "layers": layers}
        line = (f"engine decode step {name:5s} {batch}x{ctx // 1024}k ({layers} layers of 8B shape): {t * 1e3:.2f} ms, "
                f"{batch / t:.0f} tok/s, {base / t:.2f}x bf16 KV")
        TABLE.append(line)
        print(line, flush=True)
        del llm, rt, data
        torch.cuda.empty_cache()
    return out


@section("offline")
def run_offline(n_req: int = 256):
    roofline_seconds, run_requests = gpu_check.roofline_seconds, gpu_check.run_requests
    out = {}
    for name in ("auto", "fp8"):
        llm = LLM("dummy:llama-3-8b", device=DEV, dtype="bfloat16", kv_cache_memory="40GiB", max_num_seqs=256,
                  max_num_batched_tokens=8192, max_model_len=9216, show_progress=False, kv_cache_dtype=name)
        a = llm.engine.arch
        model = llm.engine.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - a.vocab_size * a.hidden_size * 2
        n_params = sum(p.numel() for p in model.parameters()) - a.vocab_size * a.hidden_size
        rng = random.Random(10 + n_req)
        prompts = [[rng.randrange(128000) for _ in range(rng.randint(128, 1024))] for _ in range(n_req)]
        run_requests(llm, prompts, 256)  # warm-up: the whole workload, so no kernel compiles in the timed run
        r = run_requests(llm, prompts, 256)
        roof = roofline_seconds(a, weight_bytes, n_params, [len(p) for p in prompts], 256, 256)
        tps = r["output_tokens"] / r["seconds"]
        out[name] = {"seconds": r["seconds"], "out_tok_s": tps, "roofline_s": roof, "of_roofline": roof / r["seconds"]}
        line = (f"offline {n_req} req, {name} KV: {r['seconds']:.1f} s, {tps:.0f} out tok/s, "
                f"{roof / r['seconds']:.0%} of the bf16-KV roofline")
        TABLE.append(line)
        print(line, flush=True)
        del llm
        torch.cuda.empty_cache()
    out["fp8_vs_auto"] = out["fp8"]["out_tok_s"] / out["auto"]["out_tok_s"]
    TABLE.append(f"offline fp8 KV / bf16 KV: {out['fp8_vs_auto']:.2f}x")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default="tests,capacity,kernel,decode,offline")
    ap.add_argument("--tests", default="tests/kernels")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=16, help="depth of the decode section's model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--formats", default=",".join(FORMATS), help="KV formats of the kernel and decode sections "
                    "(auto first: the others are compared with it)")
    args = ap.parse_args()
    gpu_check.OUT_PATH = os.path.join(args.out, "kv_compression.json")
    only = set(args.only.split(","))
    RESULTS["gpu"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    if "tests" in only:
        run_tests(args.tests.split(","))
    if "capacity" in only:
        run_capacity()
    if "kernel" in only:
        run_kernel(args.batch, args.ctx, args.formats.split(","))
    if "decode" in only:
        run_decode(args.batch, args.ctx, args.layers, args.formats.split(","))
    if "offline" in only:
        run_offline(args.requests)
    print("\n" + "\n".join(TABLE), flush=True)


if __name__ == "__main__":
    main()
