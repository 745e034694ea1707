"""KV eviction (``--kv-eviction streaming|snapkv|h2o``, ``SamplingParams.kv_budget``) on the CPU,
on the default model (SmolLM2-135M, fp32, 16-token blocks), against full KV in the same run:

    PYTHONPATH=$PWD python benchmarks/kv_eviction.py --out DIR [--name FILE.json]

  perplexity  over a held-out text (Python's reference documentation, ``pydoc_data.topics``,
              the first ``--tokens`` tokens) at each budget, per policy: every token given what
              the policy holds when it is computed. Streaming's prefill applies its per-query
              mask, so it equals token-by-token decoding under the budget; H2O's prefill evicts
              block by block as decoding would; SnapKV holds the prompt whole until its end, so
              its prompt perplexity is full KV's by construction (run as a check)
  passkey     a five-digit number hidden at ``--depths`` of ~``--passkey-tokens`` tokens of
              filler (one or more lengths), then asked for: found (greedy output holds it) or
              not, per policy at one budget: tokens, or a share of each prompt ("20%"). Full
              KV runs once per prompt. Streaming loses a needle that left its window (its known
              weakness); the scored policies keep what attention pointed at

Each run's seconds, and the load average and the CPU time stolen by the hypervisor before and
after, go into the JSON: the CPU box may
be shared, so the times are not a speed measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time

import torch

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


def steal_jiffies() -> int | None:
    """CPU time the hypervisor gave other guests (``/proc/stat``), where Linux reports it."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return None


def budget_for(spec: str, prompt_tokens: int) -> int:
    """``spec``: tokens ("256") or a share of the prompt ("20%")."""
    if spec.endswith("%"):
        frac = float(spec[:-1]) / 100
        if not 0 < frac <= 1:
            raise SystemExit(f"--passkey-budget: a share must lie in (0%, 100%], got {spec!r}")
        return int(frac * prompt_tokens)
    return int(spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="kv_eviction_cpu.json", help="JSON file written under --out")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--passkey-tokens", default="1024", help="prompt lengths, comma-separated")
    ap.add_argument("--passkey-budget", default="256", help='tokens, or a share of each prompt: "20%%"')
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--policies", default="streaming,snapkv,h2o")
    ap.add_argument("--no-perplexity", action="store_true", help="passkey retrieval only")
    ap.add_argument("--no-passkey", action="store_true", help="perplexity only")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    lengths = [int(n) for n in args.passkey_tokens.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    res = {"perplexity": {}, "passkey": [], "seconds": {}, "torch_threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "steal_jiffies_start": steal_jiffies(),
           "argv": sys.argv[1:]}
    t_all = time.perf_counter()
    for policy in args.policies.split(","):
        llm = None
        gc.collect()  # the previous policy's engine, before the next one's pool
        llm = LLM(show_progress=False, max_model_len=max([args.tokens] * (not args.no_perplexity)
                                                         + lengths * (not args.no_passkey)) + 64,
                  kv_eviction=policy, enable_prefix_caching=False)
        tok = llm.engine.tokenizer
        res.update(model=llm.engine.model_name, block_size=llm.config.cache.block_size)
        if not args.no_perplexity:
            ids = heldout_ids(tok, args.tokens)
            res["tokens"] = len(ids)
            ppl_of = res["perplexity"].setdefault(policy, {})
            print(f"{policy}: perplexity over {len(ids)} tokens of pydoc_data.topics")
            for b in ([None] if "full" not in res else []) + budgets:
                t0 = time.perf_counter()
                ppl = perplexity(llm, ids, b)
                dt = time.perf_counter() - t0
                if b is None:
                    res["full"] = ppl
                else:
                    ppl_of[str(b)] = ppl
                res["seconds"][f"perplexity/{policy if b else 'full'}/{b or len(ids)}"] = dt
                print(f"  budget {'full' if b is None else b:>5}: {ppl:8.3f}   ({dt:.1f} s)", flush=True)
        for n_tokens in [] if args.no_passkey else lengths:
            print(f"{policy}: passkey, ~{n_tokens} tokens, budget {args.passkey_budget}")
            for d, key, text in passkey_prompts(tok, n_tokens, depths):
                n = len(tok.encode(text))
                for b in (None, budget_for(args.passkey_budget, n)):
                    if b is None and any(r["budget"] is None and r["depth"] == d and r["prompt_tokens"] == n
                                         for r in res["passkey"]):
                        continue  # full KV: once
                    t0 = time.perf_counter()
                    out = llm.generate([text], SamplingParams(max_tokens=8, temperature=0, kv_budget=b),
                                       use_tqdm=False)[0]
                    got = out.outputs[0].text
                    res["passkey"].append({"policy": None if b is None else policy, "depth": d, "context": n_tokens,
                                           "prompt_tokens": n, "budget": b, "key": key, "output": got,
                                           "found": key in got, "seconds": time.perf_counter() - t0})
                    print(f"  depth {d:.2f} ({n} tokens) budget {'full' if b is None else b:>5}: "
                          f"{'found' if key in got else 'lost '} {got!r}", flush=True)
        save(args, res, t_all, complete=False)  # what a cut-short run measured stays
    save(args, res, t_all, complete=True)


def save(args, res: dict, t_all: float, complete: bool) -> None:
    res.update(loadavg_end=os.getloadavg(), steal_jiffies_end=steal_jiffies(),
               seconds_total=time.perf_counter() - t_all, complete=complete)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
