"""Speculative decoding: what drafts buy at batch 1, and what a verify step costs.

Default mode (CPU or GPU): the default model decoding greedily, one request at a time, with and
without n-gram drafts, best of ``--repeats`` alternated runs, on two workloads:
- editing: chat prompts that contain the text the answer reproduces (fix a list, rewrite a
  passage): drafts copied from the prompt are often right;
- chat: open questions, where the answer rarely repeats the prompt.
Prints output tokens/s of both sides, the speedup and the mean acceptance length (tokens a
verify step emits: accepted drafts + 1).

``--verify-cost`` (for a GPU, e.g. ``--model dummy:llama-3-8b``): the time of one verify step of
``k + 1`` tokens per sequence against a 1-token decode step, for k = 1..8 at batch 1, 8, 32, 128
and a context of ``--context`` tokens, both run as the engine runs them: the decode step and a
verify step whose ``B * (k + 1)`` rows fit a captured CUDA graph replay it (decode rows,
``kvserve/engine/decode_rows.py``; graphs up to ``--graph-rows``), a larger verify step runs
eagerly through the prefill kernel. The peer in the same run is the prefill-shaped verify step
(eager) at every size. The ratio is what a step of k drafts must beat in accepted tokens; it
sets ``verify_token_budget``.

    python benchmarks/speculative.py                                   # CPU, default model
    python benchmarks/speculative.py --verify-cost --model dummy:llama-3-8b --out $OUT   # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine import decode_rows  # noqa: E402

FRUIT = "apples, pears, plums, cherries, grapes, lemons, limes, peaches, figs, dates, kiwis, mangoes"
EDITING = [
    f"Rewrite this list in alphabetical order, one item per line:\n{FRUIT}",
    "Correct the spelling and repeat the text: The quick brown fox jumpes over the lazy dog. "
    "The quick brown fox jumpes over the lazy dog again and again.",
    "Copy this code and add a docstring:\n\ndef area(width, height):\n    return width * height\n",
    "Summarise, quoting its first sentence: Memory bandwidth decides the cost of decoding. Every "
    "token reads every weight once, so small batches leave the arithmetic units idle.",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
]


def run_side(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    n, t0 = 0, time.perf_counter()
    for p in prompts:  # batch 1: one request at a time
        n += len(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids)
    return n, time.perf_counter() - t0


def batch1(args) -> dict:
    common = dict(show_progress=False, kv_cache_memory="512MiB")
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                               "prompt_lookup_min": 2, "prompt_lookup_max": 5}, **common)
    out = {}
    for name, texts in (("editing", EDITING), ("chat", CHAT)):
        prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        best = {"off": float("inf"), "ngram": float("inf")}
        tokens = {}
        s = spec.stats.spec
        acc0, drafts0 = s.spec_decode_num_accepted_tokens, s.spec_decode_num_drafts
        for _ in range(args.repeats):
            for side, llm in (("off", plain), ("ngram", spec)):
                n, dt = run_side(llm, prompts, args.max_tokens)
                tokens[side] = n
                best[side] = min(best[side], dt)
        assert tokens["off"] == tokens["ngram"], tokens  # greedy: the same tokens either way
        acc, drafts = s.spec_decode_num_accepted_tokens - acc0, s.spec_decode_num_drafts - drafts0
        row = {"tokens": tokens["off"], "off_tok_s": tokens["off"] / best["off"],
               "ngram_tok_s": tokens["ngram"] / best["ngram"], "speedup": best["off"] / best["ngram"],
               "mean_acceptance_length": 1 + acc / drafts if drafts else 0.0,
               "verify_steps_share": drafts / (args.repeats * tokens["ngram"])}
        out[name] = row
        print(f"{name:8s} {row['tokens']:5d} tokens | off {row['off_tok_s']:7.2f} tok/s | ngram k={args.k} "
              f"{row['ngram_tok_s']:7.2f} tok/s | speedup {row['speedup']:.2f}x | "
              f"mean acceptance length {row['mean_acceptance_length']:.2f}", flush=True)
    return out


@torch.inference_mode()
def verify_cost(args) -> dict:
    llm = LLM(args.model, show_progress=False, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(args.batches) * 9, max_model_len=args.context + 16,
              cuda_graph_max_batch=args.graph_rows,  # speculation on: graphs for verify rows too
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    rt = llm.engine.runner
    bs = llm.engine.block_size
    per = -(-(args.context + 9) // bs)
    if per * max(args.batches) > llm.engine.num_kv_blocks:
        raise SystemExit(f"the KV pool holds {llm.engine.num_kv_blocks} blocks; lower --context")
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)

    def step_time(B: int, q: int, rows: bool | None = None) -> float:
        seqs = [(args.context, q, list(range(i * per, (i + 1) * per))) for i in range(B)]
        ids = [1] * (B * q)
        best = float("inf")
        rt._forward(ids, seqs, rows=rows)  # warm-up: first calls at a shape pay for allocation and tuning
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            hidden, _ = rt._forward(ids, seqs, rows=rows)
            rt._logits(hidden)  # every position's logits: what verification reads
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def path(B: int, q: int) -> str:
        """Whether the engine replays a graph for the step (``ModelRunner._forward``'s rule)."""
        g = rt.graphs
        rows = q == 1 or (rt.config.kernel.decode_rows != "never" and not rt.kv_format.kivi
                          and decode_rows.eligible([(args.context, q, [])]))
        return "graph" if g is not None and rows and g.fits(B * q, per, q > 1) else "eager"

    out = {}
    for B in args.batches:
        base = step_time(B, 1)
        row = {"decode_ms": base * 1e3, "decode_path": path(B, 1)}
        for k in range(1, 9):
            row[f"k{k}"] = step_time(B, k + 1) / base
            row[f"k{k}_path"] = path(B, k + 1)
            row[f"k{k}_prefill_shaped"] = step_time(B, k + 1, rows=False) / base
        out[str(B)] = row
        print(f"batch {B:4d}: 1-token step {base * 1e3:7.2f} ms ({row['decode_path']}) | verify/decode time, "
              "k=1..8: " + " ".join(f"{row[f'k{k}']:.2f}{'g' if row[f'k{k}_path'] == 'graph' else 'e'}"
                                    for k in range(1, 9))
              + " | prefill-shaped: " + " ".join(f"{row[f'k{k}_prefill_shaped']:.2f}" for k in range(1, 9)),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="--verify-cost: tokens already in each sequence")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--graph-rows", type=int, default=512,
                    help="--verify-cost: the most rows a decode CUDA graph holds (cuda_graph_max_batch)")
    ap.add_argument("--out", default=None, help="directory for speculative.json")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "model": args.model or "default", "args": {k: v for k, v in vars(args).items() if k != "out"}}
    res["verify_cost" if args.verify_cost else "batch1"] = verify_cost(args) if args.verify_cost else batch1(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "speculative.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
