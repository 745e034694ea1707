"""Streaming KV eviction (``--kv-eviction streaming``, ``SamplingParams.kv_budget``) on the CPU,
on the default model (SmolLM2-135M, fp32, 16-token blocks), against full KV in the same run:

    PYTHONPATH=$PWD python benchmarks/kv_eviction.py --out DIR

  perplexity  over a held-out text (Python's reference documentation, ``pydoc_data.topics``,
              the first ``--tokens`` tokens) at each budget: every token given the sink block
              and its recent blocks, as a request decoding under that budget sees them (the
              engine's prefill applies the same per-query mask, so it equals token-by-token
              decoding under the budget)
  passkey     a five-digit number hidden at a few depths of ~``--passkey-tokens`` tokens of
              filler, then asked for: found (greedy output holds it) or not, per budget. Tokens
              outside the sinks and the recent window are gone, so a needle evicted is lost:
              StreamingLLM's known weakness
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def heldout_ids(tok, n: int) -> list[int]:
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tok.encode(text)[:n]


def perplexity(llm: LLM, ids: list[int], budget: int | None) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, kv_budget=budget)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    lps = [p for p in out.prompt_logprobs if p is not None]
    assert len(lps) == len(ids) - 1
    return math.exp(-sum(p[t].logprob for p, t in zip(lps, ids[1:])) / len(lps))


def passkey_prompts(tok, n_tokens: int, depths: list[float], seed: int = 0) -> list[tuple[float, str, str]]:
    rng = random.Random(seed)
    per = len(tok.encode(FILLER))
    reps = max(1, (n_tokens - 60) // per)
    out = []
    for d in depths:
        key = str(rng.randrange(10000, 100000))
        at = int(reps * d)
        text = (FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + FILLER * (reps - at) + "What is the pass key? The pass key is")
        out.append((d, key, text))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--passkey-tokens", type=int, default=1024)
    ap.add_argument("--passkey-budget", type=int, default=256)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    llm = LLM(show_progress=False, max_model_len=max(args.tokens, args.passkey_tokens) + 64,
              kv_eviction="streaming", enable_prefix_caching=False)
    tok = llm.engine.tokenizer
    ids = heldout_ids(tok, args.tokens)
    res = {"model": llm.engine.model_name, "block_size": llm.config.cache.block_size, "tokens": len(ids),
           "perplexity": {}, "passkey": []}
    print(f"perplexity over {len(ids)} tokens of pydoc_data.topics")
    for b in [None] + budgets:
        t0 = time.perf_counter()
        ppl = perplexity(llm, ids, b)
        res["perplexity"]["full" if b is None else str(b)] = ppl
        print(f"  budget {'full' if b is None else b:>5}: {ppl:8.3f}   ({time.perf_counter() - t0:.1f} s)", flush=True)
    depths = [float(d) for d in args.depths.split(",")]
    print(f"passkey, ~{args.passkey_tokens} tokens")
    for d, key, text in passkey_prompts(tok, args.passkey_tokens, depths):
        n = len(tok.encode(text))
        for b in (None, args.passkey_budget):
            out = llm.generate([text], SamplingParams(max_tokens=8, temperature=0, kv_budget=b), use_tqdm=False)[0]
            got = out.outputs[0].text
            res["passkey"].append({"depth": d, "prompt_tokens": n, "budget": b, "key": key, "output": got,
                                   "found": key in got})
            print(f"  depth {d:.1f} ({n} tokens) budget {'full' if b is None else b:>5}: "
                  f"{'found' if key in got else 'lost '} {got!r}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_eviction_cpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
