"""Tensor parallelism: the same engine at TP = 1 and TP = N, batch-1 decode and offline throughput.

Each size runs in an engine of its own, one after the other, on the same workload and weights
(``dummy:`` weights are drawn whole and cut per rank, so every size runs the same model; the
script checks the greedy tokens agree):

    decode      one request, a ``--prompt-len`` prompt, ``--decode-tokens`` new tokens, greedy,
                EOS ignored: tok/s over the decode steps (time to first token excluded)
    throughput  ``--num-prompts`` requests at once, prompt lengths uniform in
                [--min-prompt, --max-prompt], outputs in [--min-output, --max-output]: output tok/s

On a host with two GPUs (one per rank, NCCL), Llama-3-8B's shape in bf16:

    PYTHONPATH=$PWD python benchmarks/tensor_parallel.py --out $OUT

On the CPU (gloo; the ranks share the host's cores):

    PYTHONPATH=$PWD python benchmarks/tensor_parallel.py --device cpu --model dummy:tiny \\
        --num-prompts 32 --max-prompt 256 --max-output 64 --prompt-len 128 --decode-tokens 128

Prints a table; writes ``tensor_parallel.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_prompts)]
    return prompts, [rng.randint(args.min_output, args.max_output) for _ in prompts]


def run_size(args, size: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=size, show_progress=False,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager)
    start = time.perf_counter() - t0
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(args.seed + 1)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    greedy = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    tokens = out.outputs[0].token_ids
    prompts, outputs = workload(args, vocab)
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == outputs
    llm.shutdown()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next size's rank 0 sizes its KV pool by the free memory
    return {"tensor_parallel_size": size, "start_s": round(start, 2),
            "decode_tok_s": round((len(tokens) - 1) / decode_s, 2), "decode_tokens": tokens,
            "throughput_s": round(wall, 3), "throughput_tok_s": round(sum(outputs) / wall, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated (the first: the baseline)")
    ap.add_argument("--kv-cache-memory", default=None, help="per rank (default: free GPU memory, 2 GiB on the CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    runs = [run_size(args, int(s)) for s in args.sizes.split(",")]
    base = runs[0]
    agree = all(r["decode_tokens"] == base["decode_tokens"] for r in runs)
    print(f"{args.model} on {args.device}: greedy tokens {'agree' if agree else 'DIFFER'} across sizes")
    print(f"{'TP':>3} {'start s':>8} {'batch-1 decode tok/s':>21} {'x':>6} {'throughput tok/s':>17} {'x':>6}")
    for r in runs:
        print(f"{r['tensor_parallel_size']:>3} {r['start_s']:>8.1f} {r['decode_tok_s']:>21.2f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:>6.2f} {r['throughput_tok_s']:>17.2f} "
              f"{r['throughput_tok_s'] / base['throughput_tok_s']:>6.2f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tensor_parallel.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "host": platform.node(), "greedy_agree": agree,
                   "runs": [{k: v for k, v in r.items() if k != "decode_tokens"} for r in runs]}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
