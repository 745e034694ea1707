"""Decode on the CPU: kvserve against llama.cpp (llama-cpp-python) on the same GGUF file, in one
run.

    PYTHONPATH=$PWD python benchmarks/cpu_peer.py --out $OUT     # needs `pip install llama-cpp-python`

Both decode the same prompts greedily (64 new tokens each, EOS ignored), one request at a time:
kvserve in each configuration ``--sides`` names (default: ``auto``, what a plain ``LLM(path)``
runs, its one-sequence steps compiled where that applies; ``float32``; a side ``DTYPE+QUANT``,
e.g. ``auto+none``, also sets ``quantization``, and ``+eager`` keeps every step eager,
``KernelConfig(cpu_compile=False)``),
llama.cpp on the file's own blocks with ``--threads`` threads (default: torch's thread count,
which kvserve uses). The sides alternate, prompt by prompt, ``--repeats`` rounds; the median of
each side's tokens per second (new tokens over the whole request, prompt included) is
reported, with the load average. Then each kvserve side serves ``--batch`` requests at once,
against llama.cpp's batch-1 rate (llama-cpp-python decodes one sequence at a time); every side
prefills a ``--prefill-tokens`` held-out prompt (time to the first token); and each kvserve
side's perplexity over ``--perplexity-tokens`` held-out tokens (Python's reference
documentation) shows what its weights cost in quality.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.quality import heldout_ids, perplexity  # noqa: E402
from kvserve.config import KernelConfig  # noqa: E402
from kvserve.models.loader import default_model_path  # noqa: E402

PROMPTS = ["Write a story about a dragon who learns to cook.", "Explain how a hash table works, step by step.",
           "List ten fruits and the colour of each.", "Why is the sky blue? Answer for a child."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--sides", default="auto,float32",
                    help="kvserve's sides, comma-separated: a dtype, or DTYPE+QUANTIZATION (e.g. auto+none), "
                         "+eager to keep every step eager (e.g. auto+eager)")
    ap.add_argument("--batch", type=int, default=16, help="requests at once on each kvserve side (0: skip)")
    ap.add_argument("--prefill-tokens", type=int, default=1000,
                    help="time to the first token of a held-out prompt this long, every side (0: skip)")
    ap.add_argument("--perplexity-tokens", type=int, default=2048, help="held-out tokens scored per side (0: skip)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu_linear")
    a = ap.parse_args()
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python") from None
    path = a.model or default_model_path()
    engines, about = {}, {}
    for side in a.sides.split(","):
        d, *rest = side.split("+")
        q = next((r for r in rest if r != "eager"), None)
        llm = LLM(path, dtype=d, quantization=q, show_progress=False, kv_cache_memory="256MiB",
                  max_model_len=max(2048, a.perplexity_tokens + 1, a.prefill_tokens + 1),
                  kernel=KernelConfig(cpu_compile=False if "eager" in rest else None))
        rt = llm.engine.runner
        engines[side] = llm
        about[side] = {"dtype": str(rt.dtype).removeprefix("torch."), "gguf_tensors_packed": len(rt.packed_weights),
                       "compiled": rt.compiled is not None, "startup_s": dict(rt.startup_seconds)}
    ours = next(iter(engines.values()))
    peer = Llama(model_path=path, n_threads=a.threads, n_threads_batch=a.threads,
                 n_ctx=max(2048, a.prefill_tokens + 16), verbose=False)
    prompts = [ours.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)

    def runner(llm: LLM):
        return lambda ids: llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids

    def run_peer(ids: list[int]) -> list[int]:
        peer.reset()
        out = []
        for t in peer.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy; EOS does not stop it
            out.append(int(t))
            if len(out) == a.max_tokens:
                break
        return out

    sides = {name: runner(llm) for name, llm in engines.items()} | {"llama.cpp": run_peer}
    for run in sides.values():
        run(prompts[0][:8])  # warm
    rates = {s: [] for s in sides}
    tokens = {s: [] for s in sides}  # the first round's, per prompt
    load = [os.getloadavg()[0]]
    for r in range(a.repeats):
        for ids in prompts:
            for side, run in sides.items():
                t = time.perf_counter()
                got = run(ids)
                rates[side].append(len(got) / (time.perf_counter() - t))
                if r == 0:
                    tokens[side].append(got)
        load.append(os.getloadavg()[0])
    med = {s: statistics.median(r) for s, r in rates.items()}
    ratio = {s: med[s] / med["llama.cpp"] for s in engines}
    same = {s: sum(tokens[s][i] == tokens["llama.cpp"][i] for i in range(len(prompts))) for s in engines}
    res = {"model": os.path.basename(path), "llama_cpp_python": llama_cpp.__version__, "threads": a.threads,
           "torch_threads": torch.get_num_threads(), "sides": about,
           "max_tokens": a.max_tokens, "prompts": len(prompts), "repeats": a.repeats, "tok_s": rates,
           "median_tok_s": med, "ratio_over_llama_cpp": ratio, "first_round_greedy_equal_to_llama_cpp": same,
           "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")}
    print(f"batch-1 decode, {res['model']}, llama.cpp ({a.threads} threads) {med['llama.cpp']:.1f} tok/s; "
          + "; ".join(f"kvserve {s} ({about[s]['dtype']}, {about[s]['gguf_tensors_packed']} GGUF tensors packed) "
                      f"{med[s]:.1f} tok/s ({ratio[s]:.2f}x, greedy equal on {same[s]} of {len(prompts)})"
                      for s in engines), flush=True)
    if a.batch:  # every kvserve side, rounds alternated
        batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(a.batch)]
        rates_b = {s: [] for s in engines}
        for _ in range(a.repeats):
            for s, llm in engines.items():
                t = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                rates_b[s].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        load.append(os.getloadavg()[0])
        tput = {s: statistics.median(r) for s, r in rates_b.items()}
        res["batch"] = {"requests": a.batch, "tok_s": rates_b, "median_tok_s": tput,
                        "over_llama_cpp_batch1": {s: v / med["llama.cpp"] for s, v in tput.items()}}
        print(f"{a.batch} requests at once: " + "; ".join(
            f"kvserve {s} {v:.1f} tok/s ({v / med['llama.cpp']:.2f}x llama.cpp's batch-1 rate)"
            for s, v in tput.items()), flush=True)
    if a.prefill_tokens:  # time to the first token of one held-out prompt, every side
        ids = heldout_ids(ours.get_tokenizer(), a.prefill_tokens + 50 * a.repeats)
        one = SamplingParams(max_tokens=1, temperature=0)
        ttft = {s: [] for s in sides}
        for r in range(a.repeats):  # a different prompt each round: no prefix-cache hits
            p = ids[50 * r: 50 * r + a.prefill_tokens]
            for s, llm in engines.items():
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
                ttft[s].append(time.perf_counter() - t)
            t = time.perf_counter()
            peer.reset()
            next(iter(peer.generate(p, temp=0.0, top_k=1, reset=True)))
            ttft["llama.cpp"].append(time.perf_counter() - t)
        load.append(os.getloadavg()[0])
        res["prefill"] = {"tokens": a.prefill_tokens, "seconds": ttft,
                          "median_s": {s: statistics.median(v) for s, v in ttft.items()}}
        print(f"first token of a {a.prefill_tokens}-token prompt: " + "; ".join(
            f"{s} {statistics.median(v):.3f} s" for s, v in ttft.items()), flush=True)
    if a.perplexity_tokens:
        ids = heldout_ids(ours.get_tokenizer(), a.perplexity_tokens)
        res["perplexity"] = {s: perplexity(llm, ids) for s, llm in engines.items()} | {"tokens": len(ids)}
        print(f"perplexity over {len(ids)} held-out tokens: "
              + ", ".join(f"{s} {res['perplexity'][s]:.3f}" for s in engines), flush=True)
    res["loadavg_1min"] = load
    print(f"load average {min(load):.1f}-{max(load):.1f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cpu_peer_llama_cpp.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
