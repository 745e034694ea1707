"""On the GPU in one run: kernel tests at real sizes, parity, then the fast-path benchmarks.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out $OUT            # everything
    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out $OUT --quick    # no transformers generate peers

Sections (each writes into one JSON; a failing section is recorded and the rest still run):
  tests      pytest tests/kernels tests/test_cuda.py on the GPU (real-size kernel cases run there)
  kernels    paged decode attention (batch 64 x 4k, GQA 32/8) against contiguous SDPA; paged
             prefill attention (8k causal) against SDPA's cuDNN and flash backends
  parity     Llama-3-8B shape, dummy bf16 weights: kvserve's logits against transformers' forward
             on the same weights (prefill and decode rows)
  decode     batch-1 decode, 512-token and ~8k-token prompts, 256 new tokens: tok/s and MBU;
             transformers eager generate in the same run; at 512 also without PDL, with cuBLAS
             products, and with the separate RoPE + KV write kernel
  launches   kernels per decode step (PyTorch profiler) for kvserve eager and transformers eager;
             decode step time with and without CUDA graphs
  prefill    one 8,192-token prompt: whole-model MFU; transformers' forward in the same run
  offline    256 requests (prompts U[128, 1024], 256 new each, ignore_eos) against the workload's
             roofline and transformers' generate_batch; then 1,024 requests (kvserve only)
Ceilings from ../shared/GPU.md: 4.25 TB/s copy, 793 TFLOP/s bf16.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402
from kvserve.engine.device import GpuTimer  # noqa: E402
from kvserve.layers.attention import get_backend  # noqa: E402

HBM = 4.25e12
PEAK = 793e12
RESULTS: dict = {"date": time.strftime("%Y-%m-%d"), "sections": {}}
TABLE: list[str] = []


def section(name):
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            print(f"\n=== {name} ===", flush=True)
            try:
                RESULTS["sections"][name] = fn(*a, **k) or {}
            except Exception as e:  # record and go on: one broken section must not hide the rest
                traceback.print_exc()
                RESULTS["sections"][name] = {"error": repr(e)}
                TABLE.append(f"{name}: FAILED {e!r}"[:200])
            RESULTS["sections"].setdefault(name, {})["seconds"] = round(time.perf_counter() - t0, 1)
            save()
            if torch.cuda.is_available():  # what the section left in the allocator's cache
                torch.cuda.empty_cache()
        return run
    return wrap


OUT_PATH = "benchmarks/results/gpu_check.json"


def save():
    """After every section, so a run cut short still leaves what it measured."""
    os.makedirs(os.path.dirname(OUT_PATH) or ".", exist_ok=True)
    with open(OUT_PATH, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def bench(fn, reps: int = 50) -> float:
    """Median seconds, CUDA events, after warm-up."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=reps * 4, return_mode="median") / 1e3


@section("tests")
def run_tests(paths):
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                       capture_output=True, text=True)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    print("\n".join(tail))
    TABLE.append(f"tests (kernels + cuda): rc={p.returncode} {tail[-1] if tail else ''}")
    return {"rc": p.returncode, "tail": tail}


@section("kernels")
def run_kernels():
    from kvserve.kernels.common import SplitCounters
    from kvserve.kernels.decode_attention import num_splits, paged_decode_attention, paged_decode_attention_ref
    from kvserve.kernels.prefill_attention import paged_prefill_attention
    dev, dt = torch.device("cuda"), torch.bfloat16
    counters = SplitCounters()  # (kept across launches, as the engine's backend keeps them)
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    # -- decode: 64 x 4k, 32 q heads / 8 kv heads, head 128, pages of 16 -------------------
    B, ctx, H, KVH, D, page = 64, 4096, 32, 8, 128, 16
    per = ctx // page
    nb = B * per + 7
    kc = torch.randn(nb, page, KVH, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn(nb, page, KVH, D, device=dev, dtype=dt, generator=g)
    tables = torch.randperm(nb, device=dev, generator=g)[:B * per].view(B, per).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, D, device=dev, dtype=dt, generator=g)
    kv_bytes = 2 * B * ctx * KVH * D * 2
    o = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, counters=counters)
    ref = paged_decode_attention_ref(q[:2], kc, vc, tables[:2], lens[:2], D ** -0.5)
    err = ((o[:2].double() - ref).norm() / ref.norm()).item()
    variants = {}
    for splits in sorted({1, 2, 4, num_splits(B, KVH, dev)}):
        for bn in (32, 64, 128):
            try:
                t = bench(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, splits=splits, block_n=bn,
                                                         counters=counters))
                variants[f"splits={splits},block_n={bn}"] = kv_bytes / t / 1e12
            except Exception as e:
                variants[f"splits={splits},block_n={bn}"] = repr(e)[:80]
    t_default = bench(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, counters=counters))
    # contiguous SDPA peer over the same amount of K/V
    kq = kc[tables.long()].view(B, ctx, KVH, D).transpose(1, 2).contiguous()
    vq = vc[tables.long()].view(B, ctx, KVH, D).transpose(1, 2).contiguous()
    qq = q.view(B, H, 1, D)
    t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kq, vq, enable_gqa=True))
    out["decode"] = {"rel_err_vs_fp64": err, "tb_s": kv_bytes / t_default / 1e12, "ms": t_default * 1e3,
                     "sdpa_contiguous_tb_s": kv_bytes / t_sdpa / 1e12, "variants_tb_s": variants}
    TABLE.append(f"decode attn 64x4k GQA 32/8: {kv_bytes / t_default / 1e12:.2f} TB/s (SDPA contiguous "
                 f"{kv_bytes / t_sdpa / 1e12:.2f}; ratio {t_sdpa / t_default:.2f}), rel err {err:.1e}")
    print(json.dumps(out["decode"], indent=1))
    # -- prefill: one 8k causal prompt through the paged kernel --------------------------
    T = 8192
    nb = T // page
    kc = torch.randn(nb, page, KVH, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn(nb, page, KVH, D, device=dev, dtype=dt, generator=g)
    table = torch.randperm(nb, device=dev, generator=g).view(1, nb).to(torch.int32)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    sl = torch.tensor([T], dtype=torch.int32, device=dev)
    flops = 2 * 2 * T * T * D * H / 2  # QK^T and PV, causal half
    pv = {}
    for cfg in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3)):
        bm, bn, w, st = cfg
        key = f"bm={bm},bn={bn},w={w},s={st}"
        try:
            t = bench(lambda: paged_prefill_attention(q, kc, vc, table, cu, sl, T, D ** -0.5, block_m=bm,
                                                      block_n=bn, num_warps=w, num_stages=st), reps=10)
            pv[key] = flops / t / 1e12
        except Exception as e:
            pv[key] = repr(e)[:80]
        print(key, pv[key], flush=True)
    t_ours = bench(lambda: paged_prefill_attention(q, kc, vc, table, cu, sl, T, D ** -0.5), reps=10)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = table[0].long()
    kk = kc[order].view(T, KVH, D).transpose(0, 1).repeat_interleave(H // KVH, 0)[None].contiguous()
    vv = vc[order].view(T, KVH, D).transpose(0, 1).repeat_interleave(H // KVH, 0)[None].contiguous()
    qq = q.transpose(0, 1)[None].contiguous()
    peers = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                t = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True), reps=10)
            peers[name] = flops / t / 1e12
        except Exception as e:
            peers[name] = repr(e)[:80]
    o = paged_prefill_attention(q, kc, vc, table, cu, sl, T, D ** -0.5)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        r = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)
    perr = ((o.float() - r.float()).norm() / r.float().norm()).item()
    out["prefill"] = {"tflops": flops / t_ours / 1e12, "variants_tflops": pv, "sdpa_tflops": peers,
                      "rel_diff_vs_sdpa_flash": perr}
    TABLE.append(f"prefill attn 8k causal (paged): {flops / t_ours / 1e12:.0f} TFLOP/s; SDPA cudnn "
                 f"{peers.get('cudnn')}, flash {peers.get('flash')}; rel diff {perr:.1e}")
    print(json.dumps(out["prefill"], indent=1))
    return out


def use_kernels(llm, kernel: KernelConfig) -> None:
    """The engine's attention backend made again with ``kernel`` (every layer follows its
    choices), and the decode graphs captured again with it."""
    runner = llm.engine.runner
    if runner.backend.kernel == kernel:
        return
    runner.backend = get_backend(runner.backend.name, kernel)
    if runner.graphs is not None:
        runner.capture_graphs()


def make_llm(args, **kw):
    return LLM("dummy:llama-3-8b", device="cuda", dtype="bfloat16", kv_cache_memory=args.kv_memory,
               max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=9216, show_progress=True,
               cuda_graph_capture="startup", **kw)


def hf_peer(llm):
    from benchmarks.offline_throughput import load_transformers
    try:
        hf = load_transformers(llm, torch.bfloat16, torch.device("cuda"))
    except ValueError as e:  # a peer that is not the same model is no peer
        print(f"transformers peer unusable: {e}")
        TABLE.append(f"transformers peer unusable: {e}"[:300])
        return None
    RESULTS["transformers_rope"] = str(getattr(hf.config, "rope_parameters", None))
    print("transformers peer rope:", RESULTS["transformers_rope"])
    return hf


def run_requests(llm, prompts, max_tokens) -> dict:
    """Run ``prompts`` to completion, greedy. The prefix cache starts empty: a rerun of the same
    prompts (the async A/B) must prefill them again, not hit what the last run cached."""
    eng = llm.engine
    eng.kv.pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    base = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        eng.add_request(f"{base}{i}", {"prompt_token_ids": p}, params)
    torch.cuda.synchronize()
    gen0, prompt0 = eng.stats.generation_tokens, eng.stats.prompt_tokens
    pre0 = eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    first = None
    steps = 0
    toks = {}
    while eng.has_unfinished_requests():
        for o in eng.step(only_finished=True):
            toks[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if first is None and eng.stats.generation_tokens > gen0:
            first = time.perf_counter()
    end = time.perf_counter()
    n = sum(len(t) for t in toks.values())
    return {"seconds": end - t0, "ttft": first - t0, "decode_seconds": end - first, "output_tokens": n,
            "steps": steps, "tokens": [toks[f"{base}{i}"] for i in range(len(prompts))],
            "preemptions": eng.scheduler.num_preemptions - pre0,
            "prompt_tokens_computed": eng.stats.prompt_tokens - prompt0}


@section("parity")
def run_parity(llm, hf):
    """Logits of kvserve and transformers on the same bf16 weights: prefill rows (a batch of
    prompts through the paged prefill kernel, and a single prompt through SDPA) and decode rows
    (graph replays), compared by relative error and top-1 agreement."""
    runner = llm.engine.runner
    captured = []
    orig = runner.model.compute_logits

    def grab(h):
        lg = orig(h)
        captured.append(lg.detach().clone())
        return lg
    runner.model.compute_logits = grab
    rng = random.Random(5)
    prompts = [[rng.randrange(128000) for _ in range(n)] for n in (37, 300, 900)]
    try:
        res_single = run_requests(llm, prompts[:1], 8)
        n_single = len(captured)
        res_batch = run_requests(llm, prompts, 8)
    finally:
        runner.model.compute_logits = orig
    # Per captured step: rows in batch order. Rebuild each row's sequence; compare with
    # transformers in bf16 (the peer) and in float32 (the truth both bf16 runs approximate):
    # random weights make a deep net sensitive to rounding, so "within bf16 tolerance" means
    # kvserve is no further from float32 than transformers' own bf16 run is.
    import copy
    single_rows = [lg[0] for lg in captured[:n_single]]
    batch_rows = [[lg[i] for lg in captured[n_single:]] for i in range(3)]
    checks = [(prompts[0], res_single["tokens"][0], single_rows)]
    checks += [(prompts[i], res_batch["tokens"][i], batch_rows[i]) for i in range(3)]
    hf32 = copy.deepcopy(hf).float()
    e_ours_hf, e_ours_32, e_hf_32, top1, top1_hf, rows = [], [], [], 0, 0, 0
    per_check = []
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        for prompt, toks, lrows in checks:
            per_check.append(len(e_ours_32))
            seq = torch.tensor([prompt + toks], device="cuda")
            ref = hf(seq).logits[0].float()
            ref32 = hf32(seq).logits[0].float()
            for j, lg in enumerate(lrows[:len(toks)]):
                p = len(prompt) - 1 + j
                e_ours_hf.append(rel(lg, ref[p]))
                e_ours_32.append(rel(lg, ref32[p]))
                e_hf_32.append(rel(ref[p], ref32[p]))
                top1 += int(lg.argmax() == ref32[p].argmax())
                top1_hf += int(ref[p].argmax() == ref32[p].argmax())
                rows += 1
    del hf32
    torch.cuda.empty_cache()
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    bounds = per_check + [len(e_ours_32)]
    names = ["single prompt (SDPA prefill)", "batch row 0 (prefix hit)", "batch row 1", "batch row 2"]
    for name, a, b in zip(names, bounds, bounds[1:]):
        print(f"  {name}: kvserve vs fp32 mean {mean(e_ours_32[a:b]):.3e}, transformers bf16 vs fp32 "
              f"{mean(e_hf_32[a:b]):.3e}; first row {e_ours_32[a]:.3e}")
    out = {"rows": rows, "kvserve_vs_hf_bf16_mean": mean(e_ours_hf), "kvserve_vs_fp32_mean": mean(e_ours_32),
           "kvserve_vs_fp32_max": max(e_ours_32), "hf_bf16_vs_fp32_mean": mean(e_hf_32),
           "hf_bf16_vs_fp32_max": max(e_hf_32), "top1_kvserve_vs_fp32": top1 / rows,
           "top1_hf_bf16_vs_fp32": top1_hf / rows}
    TABLE.append(f"parity 8B bf16, logits rel err vs transformers fp32 on the same weights: kvserve mean "
                 f"{out['kvserve_vs_fp32_mean']:.2e} (max {out['kvserve_vs_fp32_max']:.2e}), transformers bf16 mean "
                 f"{out['hf_bf16_vs_fp32_mean']:.2e} (max {out['hf_bf16_vs_fp32_max']:.2e}); top-1 vs fp32 kvserve "
                 f"{top1}/{rows}, transformers bf16 {top1_hf}/{rows}")
    print(out)
    return out


@section("backends")
def run_backends(llm):
    """The Triton backend against the PyTorch reference backend in the same engine (same weights,
    same batch: a prefix-cache hit, a 300- and a 900-token prompt), logits per row; and every
    Triton attention call of the batch's prefill step against the reference on the same inputs."""
    from kvserve.layers.attention import TorchPagedAttention
    runner = llm.engine.runner
    rng = random.Random(7)
    prompts = [[rng.randrange(128000) for _ in range(n)] for n in (37, 300, 900)]
    orig_logits = runner.model.compute_logits
    layer_errs = []

    class Checked:
        """The Triton backend, each of its batched prefill calls also run through the reference
        backend on the same inputs."""

        def __init__(self, inner):
            self.inner, self.name, self.kernel = inner, inner.name, inner.kernel

        def prepare(self, meta, device):
            self.inner.prepare(meta, device)

        def forward(self, positions, q, k, v, rope, kc, vc, meta, scale, window=None):
            if not (meta.max_query_len > 1 and len(meta.seq_lens) > 1):
                return self.inner.forward(positions, q, k, v, rope, kc, vc, meta, scale, window=window)
            q0, k0, v0 = q.clone(), k.clone(), v.clone()
            o = self.inner.forward(positions, q, k, v, rope, kc, vc, meta, scale, window=window)
            meta.seq_tables = [meta.block_tables[i, : -(-L // meta.block_size)] for i, L in enumerate(meta.seq_lens)]
            r = TorchPagedAttention.forward(positions, q0, k0, v0, rope, kc.clone(), vc.clone(), meta, scale, window)
            per = []
            for i in range(len(meta.seq_lens)):
                a, b = meta.query_start[i], meta.query_start[i + 1]
                per.append(round(((o[a:b].float() - r[a:b].float()).norm() / r[a:b].float().norm()).item(), 5))
            layer_errs.append(per)
            return o

    def run(backend):
        captured = []
        runner.model.compute_logits = lambda h: captured.append(orig_logits(h).clone()) or captured[-1]
        saved_backend, saved_graphs = runner.backend, runner.graphs
        runner.backend = backend
        if backend.name == "torch":
            runner.graphs = None
        llm.engine.kv.pool.reset_prefix_cache()
        try:
            run_requests(llm, prompts[:1], 4)
            run_requests(llm, prompts, 4)
        finally:
            runner.model.compute_logits = orig_logits
            runner.backend, runner.graphs = saved_backend, saved_graphs
        return captured[4:]  # the batch's steps

    ref = run(get_backend("torch", runner.backend.kernel))
    got = run(Checked(get_backend("triton", runner.backend.kernel)))
    rows = [[round(((g[i] - r[i]).norm() / r[i].norm()).item(), 4) for g, r in zip(got, ref)] for i in range(3)]
    print("logits rel err triton vs torch backend, per row per step:", rows)
    print("prefill attention rel err per layer (per sequence):", layer_errs[:4], "... max",
          max(max(e) for e in layer_errs) if layer_errs else None)
    TABLE.append(f"backends 8B bf16: logits rel err triton vs torch per row (prefill step) "
                 f"{[r[0] for r in rows]}; attention per-call max "
                 f"{max(max(e) for e in layer_errs) if layer_errs else None}")
    return {"rows": rows, "layer_errs": layer_errs}


@section("decode")
def run_decode(llm, hf, args):
    a = llm.engine.arch
    # Bytes a decode step must read: every weight but the embedding table (one row of it).
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    weight_bytes -= a.vocab_size * a.hidden_size * 2
    kv_per_tok = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    rng = random.Random(1)
    out = {"weight_bytes": weight_bytes}
    default = llm.engine.runner.backend.kernel
    no_pdl = dataclasses.replace(default, pdl=False)
    modes = {"skinny GEMM + PDL": default, "skinny GEMM": no_pdl,
             "cuBLAS": dataclasses.replace(no_pdl, gemv_max_rows_linear=0, gemv_max_rows_gate_up=0,
                                           gemv_max_rows_logits=0),
             "separate RoPE + KV write": dataclasses.replace(default, fused_rope_decode=False)}
    runs = [(512, m) for m in modes] + [(8192 - 256, "skinny GEMM + PDL")]
    for plen, mode in runs:
        use_kernels(llm, modes[mode])  # (graphs captured again for another configuration)
        prompt = [rng.randrange(128000) for _ in range(plen)]
        run_requests(llm, [prompt[:64]], 4)  # warm
        timer = llm.engine.runner.gpu_timer = GpuTimer()
        r = run_requests(llm, [prompt], 256)
        llm.engine.runner.gpu_timer = None
        tps = 255 / r["decode_seconds"]
        mean_ctx = plen + 128
        mbu = (weight_bytes + kv_per_tok * mean_ctx) * tps / HBM
        gpu_step = timer.seconds / timer.steps
        key = f"ctx{plen}" + ("" if mode == "skinny GEMM + PDL" else f" {mode}")
        out[key] = {"tok_s": tps, "mbu": mbu, "ttft": r["ttft"], "gpu_ms_per_step": gpu_step * 1e3, "kernels": mode}
        line = (f"batch-1 decode, {plen}-token prompt, {mode}: {tps:.1f} tok/s, MBU {mbu:.1%} (GPU "
                f"{gpu_step * 1e3:.2f} ms of {1e3 / tps:.2f} ms per step)")
        if key != f"ctx{plen}":
            line += f"; default kernels / these {out[f'ctx{plen}']['tok_s'] / tps:.3f}x"
        if hf is not None and not args.quick and key == "ctx512":
            ids = torch.tensor([prompt], device="cuda")
            with torch.no_grad():
                hf.generate(ids[:, :64], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
            hf_tps = 256 / (time.perf_counter() - t0)
            out[key]["transformers_generate_tok_s"] = hf_tps
            line += f"; transformers eager generate {hf_tps:.1f} tok/s (ratio {tps / hf_tps:.2f}x)"
        TABLE.append(line)
        print(line, flush=True)
    use_kernels(llm, default)
    return out


@section("launches")
def run_launches(llm, hf):
    from torch.profiler import ProfilerActivity, profile
    eng, runner = llm.engine, llm.engine.runner
    rng = random.Random(2)
    prompt = [rng.randrange(128000) for _ in range(512)]

    def decode_steps(n_steps: int, graphs) -> float:
        saved = runner.graphs
        runner.graphs = graphs
        try:
            eng.add_request(f"launch-{graphs is None}", {"prompt_token_ids": prompt},
                            SamplingParams(max_tokens=n_steps + 1, temperature=0, ignore_eos=True))
            eng.step()  # prefill
            eng.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_steps - 1):
                eng.step()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / (n_steps - 1)
        finally:
            runner.graphs = saved
        while eng.has_unfinished_requests():
            eng.step()
        return dt

    def count_kernels(fn, label: str = "") -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        if label:  # where the GPU time of one step goes, by kernel
            by_name: dict = {}
            for e in kernels:
                n, t = by_name.get(e.name, (0, 0.0))
                by_name[e.name] = (n + 1, t + e.time_range.elapsed_us())
            total = sum(t for _, t in by_name.values())
            top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]
            profiles[label] = {"kernels": len(kernels), "busy_us": total,
                               "top": [(name[:90], n, round(t, 1)) for name, (n, t) in top]}
            print(f"{label}: {len(kernels)} kernels, {total:.0f} us busy")
            for name, (n, t) in top:
                print(f"   {t:8.1f} us  {n:4d}x  {name[:100]}")
        return len(kernels)

    profiles: dict = {}

    t_graph = decode_steps(64, runner.graphs)
    t_eager = decode_steps(64, None)
    # one eager decode step of kvserve, profiled
    saved = runner.graphs
    runner.graphs = None
    eng.add_request("prof", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    n_ours = count_kernels(eng.step, "eager step")
    runner.graphs = saved
    count_kernels(eng.step, "graph step")
    while eng.has_unfinished_requests():
        eng.step()
    n_hf = None
    if hf is not None:
        from transformers import DynamicCache
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            cache = DynamicCache()
            o = hf(ids, past_key_values=cache, use_cache=True)
            nxt = o.logits[:, -1:].argmax(-1)
            hf(nxt, past_key_values=cache, use_cache=True)
            n_hf = count_kernels(lambda: hf(nxt, past_key_values=cache, use_cache=True))
    out = {"step_ms_graphs": t_graph * 1e3, "step_ms_eager": t_eager * 1e3, "kernels_per_step_kvserve_eager": n_ours,
           "kernels_per_step_transformers_eager": n_hf, "profiles": profiles}
    TABLE.append(f"decode step batch 1: {t_graph * 1e3:.2f} ms with CUDA graphs, {t_eager * 1e3:.2f} ms eager; "
                 f"kernels/step kvserve {n_ours}, transformers {n_hf}")
    print(out)
    return out


@section("prefill")
def run_prefill(llm, hf):
    a = llm.engine.arch
    # Every token goes through the decoder layers; only the last row through the LM head.
    params = sum(p.numel() for p in llm.engine.runner.model.parameters()) - 2 * a.vocab_size * a.hidden_size
    T = 8192
    rng = random.Random(3)
    fresh = lambda: [rng.randrange(128000) for _ in range(T)]  # noqa: E731  (no prefix-cache hits)
    prompt = fresh()
    flops = (2 * params * T + 2 * a.vocab_size * a.hidden_size
             + 2 * 2 * a.num_layers * a.num_heads * a.head_dim * T * T / 2)
    run_requests(llm, [fresh()], 1)  # warm (compile)
    ts = []
    for _ in range(3):
        r = run_requests(llm, [fresh()], 1)
        ts.append(r["seconds"])
    t = sorted(ts)[1]
    out = {"seconds": t, "mfu": flops / t / PEAK, "flops": flops}
    line = f"prefill 8192 tokens: {t * 1e3:.0f} ms, MFU {flops / t / PEAK:.1%}"
    if hf is not None:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            hf(ids[:, :512])
            tt = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                tt.append(time.perf_counter() - t0)
        th = sorted(tt)[1]
        out["transformers_seconds"] = th
        out["transformers_mfu"] = flops / th / PEAK
        line += f"; transformers forward {th * 1e3:.0f} ms (MFU {flops / th / PEAK:.1%}, ratio {th / t:.2f}x)"
    TABLE.append(line)
    print(line)
    return out


def roofline_seconds(a, weight_bytes, n_params, prompts, n_out, concurrency):
    """Prefill FLOPs / 793 TFLOP/s + decode bytes / 4.25 TB/s, with requests decoding
    ``concurrency`` at a time (weights read once per step; each request's KV once per step)."""
    kv_tok = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    flops = sum(2 * n_params * p + 2 * a.num_layers * a.num_heads * a.head_dim * p * p for p in prompts)
    waves = -(-len(prompts) // concurrency)
    decode_bytes = waves * n_out * weight_bytes + sum(kv_tok * (p * n_out + n_out * n_out / 2) for p in prompts)
    return flops / PEAK + decode_bytes / HBM


@section("offline")
def run_offline(llm, hf, args):
    a = llm.engine.arch
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - a.vocab_size * a.hidden_size * 2
    n_params = sum(p.numel() for p in model.parameters()) - a.vocab_size * a.hidden_size
    out = {}
    for n_req in ((256,) if args.quick else tuple(map(int, args.offline_sizes.split(",")))):
        rng = random.Random(10 + n_req)
        prompts = [[rng.randrange(128000) for _ in range(rng.randint(128, 1024))] for _ in range(n_req)]
        # Warm-up: the whole workload once, untimed. A short warm-up leaves kernel variants of
        # later shapes (split counts, prefill tiles) to compile inside the timed run: the first
        # async A/B ran synchronously first and cold, and the gap was mostly that.
        run_requests(llm, prompts, 256)
        timer = llm.engine.runner.gpu_timer = GpuTimer()
        r = run_requests(llm, prompts, 256)
        llm.engine.runner.gpu_timer = None
        roof = roofline_seconds(a, weight_bytes, n_params, [len(p) for p in prompts], 256, 256)
        tps = r["output_tokens"] / r["seconds"]
        res = {"seconds": r["seconds"], "out_tok_s": tps, "roofline_s": roof, "of_roofline": roof / r["seconds"],
               "steps": r["steps"], "gpu_busy_s": timer.seconds}
        line = (f"offline {n_req} req: {r['seconds']:.1f} s, {tps:.0f} out tok/s, roofline {roof:.1f} s "
                f"({roof / r['seconds']:.0%} of roofline); GPU busy {timer.seconds:.1f} s in {r['steps']} steps")
        if hf is not None and not args.quick and n_req == 256:
            try:
                res.update(run_generate_batch(hf, prompts, 256))
                line += (f"; transformers generate_batch {res['transformers_out_tok_s']:.0f} tok/s "
                         f"(ratio {tps / res['transformers_out_tok_s']:.1f}x)")
            except Exception as e:
                traceback.print_exc()
                res["transformers_error"] = repr(e)
        out[str(n_req)] = res
        TABLE.append(line)
        print(line, flush=True)
        if args.async_ab and n_req == 256:  # the same workload with the other scheduling, same engine
            other = not llm.engine.config.async_scheduling
            with scheduling(llm, other):
                timer = llm.engine.runner.gpu_timer = GpuTimer()
                ra = run_requests(llm, prompts, 256)
                llm.engine.runner.gpu_timer = None
            same = ra["tokens"] == r["tokens"]
            tps_a = ra["output_tokens"] / ra["seconds"]
            mode = "async" if other else "sync"
            out[f"{n_req} {mode}"] = {"seconds": ra["seconds"], "out_tok_s": tps_a, "of_roofline": roof / ra["seconds"],
                                      "steps": ra["steps"], "gpu_busy_s": timer.seconds, "same_tokens": same}
            line = (f"offline {n_req} req, {mode} scheduling: {ra['seconds']:.1f} s, {tps_a:.0f} out tok/s "
                    f"({roof / ra['seconds']:.0%} of roofline; the default is {tps / tps_a:.3f}x this); GPU busy "
                    f"{timer.seconds:.1f} s in {ra['steps']} steps; tokens equal to the default's: {same}")
            if "transformers_out_tok_s" in res:
                line += f"; transformers generate_batch ratio {tps_a / res['transformers_out_tok_s']:.1f}x"
            TABLE.append(line)
            print(line, flush=True)
    return out


@contextlib.contextmanager
def scheduling(llm, async_: bool):
    """The engine switched to async (or synchronous) scheduling for the block, then back."""
    eng = llm.engine
    saved = eng.config

    def switch(on: bool):
        eng.runner.sampler.copy_ahead = on
        if eng.runner.graphs is not None:
            eng.runner.graphs.async_copies = on
    eng.config = dataclasses.replace(saved, async_scheduling=async_)
    switch(async_)
    try:
        yield
    finally:
        eng.config = saved
        switch(saved.async_scheduling)


def run_generate_batch(hf, prompts, n_new):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:4], generation_config=cfg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = hf.generate_batch(inputs=prompts, generation_config=cfg)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in res.values())
    return {"transformers_seconds": dt, "transformers_out_tokens": n, "transformers_out_tok_s": n / dt}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="skip transformers generate peers and the 1,024 run")
    ap.add_argument("--only", default="tests,kernels,parity,decode,launches,prefill,offline")
    ap.add_argument("--kv-memory", default="40GiB")
    ap.add_argument("--offline-sizes", default="256,1024", help="request counts of the offline runs")
    ap.add_argument("--no-async-ab", dest="async_ab", action="store_false",
                    help="skip the offline rerun with the other scheduling (synchronous on CUDA)")
    ap.add_argument("--tests", default="tests/kernels,tests/test_cuda.py", help="pytest paths, comma-separated")
    args = ap.parse_args()
    only = set(args.only.split(","))
    global OUT_PATH
    OUT_PATH = os.path.join(args.out, "gpu_check.json")
    RESULTS["gpu"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    import triton
    RESULTS["triton"] = triton.__version__
    if "tests" in only:
        run_tests(args.tests.split(","))
    if "kernels" in only:
        run_kernels()
    if only & {"backends", "parity", "decode", "launches", "prefill", "offline"}:
        t0 = time.perf_counter()
        llm = make_llm(args)
        RESULTS["engine_start_s"] = time.perf_counter() - t0
        g = llm.engine.runner.graphs
        if g is not None:
            RESULTS["graphs"] = {"buckets": g.buckets, "capture_s": g.capture_seconds, "mib": g.memory_bytes / 2**20}
        wants_peer = "parity" in only or not args.quick  # --quick runs no transformers peer
        hf = hf_peer(llm) if wants_peer and only & {"parity", "decode", "launches", "prefill", "offline"} else None
        if "backends" in only:
            run_backends(llm)
        if "parity" in only and hf is not None:
            run_parity(llm, hf)
        if "decode" in only:
            run_decode(llm, hf, args)
        if "launches" in only:
            run_launches(llm, hf)
        if "prefill" in only:
            run_prefill(llm, hf)
        if "offline" in only:
            run_offline(llm, hf, args)
    save()
    print("\n" + "\n".join(TABLE))


if __name__ == "__main__":
    main()
