"""CPU projections: oneDNN on weights packed at load against F.linear on the dense weights.

    PYTHONPATH=$PWD python benchmarks/cpu_linear.py --out benchmarks/results/cpu_linear
    PYTHONPATH=$PWD python benchmarks/cpu_linear.py --model /tmp/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

Three parts (``--only``), each side in the same run:
  products  every projection shape of the model (fused QKV, O, fused gate/up, down) at 1 to 64
            rows: time per product, packed and dense, and the weight bytes per second
  engine    decode of the same greedy requests at batch 1 and 8, ``KernelConfig(cpu_packed_weights=
            True)`` against ``False``: output tokens per second, and whether the tokens are equal
  dtype     the engine in bfloat16 (its projections packed where the CPU multiplies bfloat16
            natively) against float32: decode tok/s at batch 1 and 8, perplexity over held-out
            text (Python's reference documentation, ``pydoc_data.topics``), greedy tokens equal

Sides alternate (dense, packed, dense, packed ...) and the median of ``--repeats`` is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402

PROMPTS = ["Write a story about a dragon who learns to cook.", "Explain how a hash table works, step by step.",
           "List ten fruits and the colour of each.", "Why is the sky blue? Answer for a child.",
           "Describe the water cycle.", "Give three tips for writing clear code.",
           "What happens when a star dies?", "Summarise the rules of chess."]


def timed(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def products(arch, rows_list, repeats: int) -> list[dict]:
    h, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        iters = max(3, int(2e8 / (n * k * 4)))  # about 200 MB of weight reads a timing
        for rows in rows_list:
            x = torch.randn(rows, k)
            dense_t, packed_t = [], []
            for _ in range(repeats):
                dense_t.append(timed(lambda: F.linear(x, w), iters))
                packed_t.append(timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                      iters))
            d, p = statistics.median(dense_t), statistics.median(packed_t)
            out.append({"matrix": name, "shape": [n, k], "rows": rows, "dense_ms": d * 1e3, "packed_ms": p * 1e3,
                        "speedup": d / p, "packed_gb_s": n * k * 4 / p / 1e9, "dense_gb_s": n * k * 4 / d / 1e9})
            print(f"{name:8s} {n:6d}x{k:<6d} rows {rows:3d}: dense {d * 1e3:7.3f} ms, packed {p * 1e3:7.3f} ms, "
                  f"{d / p:5.2f}x", flush=True)
    return out


def alternate(llms: dict, prompts: list, max_tokens: int, repeats: int) -> tuple[dict, dict]:
    """Each engine of ``llms`` warmed, then timed on ``prompts`` in turn, ``repeats`` rounds:
    (median seconds per engine, the last round's token ids per engine)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times = {side: [] for side in llms}
    tokens = {}
    for llm in llms.values():
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm
    for _ in range(repeats):
        for side, llm in llms.items():
            t = time.perf_counter()
            res = llm.generate(prompts, sp)
            times[side].append(time.perf_counter() - t)
            tokens[side] = [o.outputs[0].token_ids for o in res]
    return {side: statistics.median(ts) for side, ts in times.items()}, tokens


def engine(model: str | None, batches, max_tokens: int, repeats: int, kv: str) -> list[dict]:
    # float32 on both sides: the dense path's dtype on every CPU (``--only dtype`` compares dtypes)
    kw = {"show_progress": False, "kv_cache_memory": kv, "max_model_len": 2048, "dtype": "float32"}
    if model:
        kw["model"] = model
    llms = {side: LLM(kernel=KernelConfig(cpu_packed_weights=side == "packed", cpu_compile=False), **kw)
            for side in ("dense", "packed")}
    out = []
    for bs in batches:
        prompts = (PROMPTS * (bs // len(PROMPTS) + 1))[:bs]
        med, tokens = alternate(llms, prompts, max_tokens, repeats)
        d, p = med["dense"], med["packed"]
        row = {"batch": bs, "dense_tok_s": bs * max_tokens / d, "packed_tok_s": bs * max_tokens / p,
               "speedup": d / p, "tokens_equal": tokens["dense"] == tokens["packed"],
               "sequences_equal": sum(a == b for a, b in zip(tokens["dense"], tokens["packed"]))}
        out.append(row)
        print(f"engine batch {bs}: dense {row['dense_tok_s']:.1f} tok/s, packed {row['packed_tok_s']:.1f} tok/s, "
              f"{row['speedup']:.2f}x, {row['sequences_equal']}/{bs} sequences equal", flush=True)
    for llm in llms.values():
        llm.shutdown()
    return out


def dtypes(model: str | None, batches, max_tokens: int, repeats: int, kv: str, ppl_tokens: int) -> dict:
    from kvserve.bench.quality import heldout_ids, perplexity
    from kvserve.layers.linear import cpu_bf16_native
    kw = {"show_progress": False, "kv_cache_memory": kv, "max_model_len": max(2048, ppl_tokens + 1)}
    if model:
        kw["model"] = model
    # both eager (a bfloat16 default model would otherwise compile its one-sequence steps)
    llms = {d: LLM(dtype=d, kernel=KernelConfig(cpu_compile=False), **kw) for d in ("float32", "bfloat16")}
    out = {"bf16_native": cpu_bf16_native(), "decode": [], "perplexity": {}}
    for bs in batches:
        prompts = (PROMPTS * (bs // len(PROMPTS) + 1))[:bs]
        med, tokens = alternate(llms, prompts, max_tokens, repeats)
        f, b = med["float32"], med["bfloat16"]
        row = {"batch": bs, "float32_tok_s": bs * max_tokens / f, "bfloat16_tok_s": bs * max_tokens / b,
               "speedup": f / b, "sequences_equal": sum(x == y for x, y in zip(tokens["float32"], tokens["bfloat16"]))}
        out["decode"].append(row)
        print(f"dtype batch {bs}: float32 {row['float32_tok_s']:.1f} tok/s, bfloat16 {row['bfloat16_tok_s']:.1f} "
              f"tok/s, {row['speedup']:.2f}x, {row['sequences_equal']}/{bs} sequences equal", flush=True)
    ids = heldout_ids(llms["float32"].get_tokenizer(), ppl_tokens)
    for d, llm in llms.items():
        out["perplexity"][d] = perplexity(llm, ids)
    out["perplexity"]["tokens"] = len(ids)
    print(f"perplexity over {len(ids)} tokens: {out['perplexity']}", flush=True)
    for llm in llms.values():
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--rows", default="1,2,4,8,9,16,32,64")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--out", default=None, help="a directory: writes cpu_linear.json there")
    ap.add_argument("--only", default="products,engine", help="parts, comma-separated: products, engine, dtype")
    ap.add_argument("--perplexity-tokens", type=int, default=2048, help="dtype: held-out tokens scored")
    args = ap.parse_args()
    only = set(args.only.split(","))
    probe_kw = dict(show_progress=False, kv_cache_memory="16MiB", kernel=KernelConfig(cpu_compile=False))
    probe = LLM(args.model, **probe_kw) if args.model else LLM(**probe_kw)
    arch = probe.engine.arch
    probe.shutdown()
    batches = [int(b) for b in args.batches.split(",")]
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args)}
    if "products" in only:
        result["products"] = products(arch, [int(r) for r in args.rows.split(",")], args.repeats)
    if "engine" in only:
        result["engine"] = engine(args.model, batches, args.max_tokens, args.repeats, args.kv_cache_memory)
    if "dtype" in only:
        result["dtype"] = dtypes(args.model, batches, args.max_tokens, args.repeats, args.kv_cache_memory,
                                 args.perplexity_tokens)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "cpu_linear.json" if only != {"dtype"} else "cpu_dtype.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
