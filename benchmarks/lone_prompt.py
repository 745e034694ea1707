"""A lone prompt of a length the engine has not met: its time against the same prompt again, with
the attention route a plain cache takes (the paged prefill kernel) and with SDPA (cuDNN first,
the prompt padded to ``sdpa_padded_len``); and SDPA alone on one layer's heads, per backend.

    PYTHONPATH=$PWD python benchmarks/lone_prompt.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/lone_prompt.py --lengths 2047,4095,8191,12000,16000 \\
        --max-num-batched-tokens 16384 --parts engine --out $OUT

cuDNN builds an execution plan for every shape it meets (PyTorch keys its cache on the exact
sizes), so the first prompt of each length pays for one. Each route runs in a process of its own
(the plan cache lives as long as the process). Engine: ``--model``, one prompt at a time, 4 new
tokens, each prompt three times with its first token changed (no prefix-cache hit); ``first`` is
the first time, ``again`` the faster of the other two. SDPA alone: 32 query heads of 128, the
prompt's K/V, causal; the first call and the median of 10. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _timed(f) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def sdpa_alone(backend: str, lengths: list[int]) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    rows = []
    for n in lengths:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))

        def f():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        first = _timed(f)
        steady = sorted(_timed(f) for _ in range(10))[5]
        rows.append({"tokens": n, "first_ms": first * 1e3, "steady_ms": steady * 1e3,
                     "tflops": 4 * n * n / 2 * 32 * 128 / steady / 1e12})
        print(backend, rows[-1], flush=True)
    return rows


def engine(route: str, a) -> list[dict]:
    from kvserve import LLM, SamplingParams
    from kvserve.layers import triton_attention
    if route == "sdpa":  # the route a plain cache's lone prompt took before: SDPA on its own K/V
        triton_attention.SDPA_PROMPT_CACHES = (*triton_attention.SDPA_PROMPT_CACHES, "plain")
    kw = {"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}
    llm = LLM(a.model, show_progress=False, max_num_seqs=32, kv_cache_memory=a.kv_cache_memory,
              max_model_len=max(a.lengths) + 300, **kw)
    vocab = llm.engine.arch.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0)
    rows = []
    for n in a.lengths:
        ids = [(n * 31 + 7 * i) % (vocab - 200) + 100 for i in range(n)]
        times = [_timed(lambda r=r: llm.generate([{"prompt_token_ids": [ids[0] + r + 1] + ids[1:]}], params,
                                                 use_tqdm=False)) for r in range(3)]
        rows.append({"tokens": n, "first_s": times[0], "again_s": min(times[1:])})
        print(route, rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--lengths", default="301,777,1503,2047,3001,4000,4097,8111")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--parts", default="sdpa,engine")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: "engine:paged", ...
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    if a.one:
        part, what = a.one.split(":")
        print(json.dumps(sdpa_alone(what, a.lengths) if part == "sdpa" else engine(what, a)))
        return
    runs = {"sdpa": ["sdpa:cudnn", "sdpa:flash"], "engine": ["engine:paged", "engine:sdpa"]}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a)}
    for part in a.parts.split(","):
        for one in runs[part]:
            p = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", one], capture_output=True,
                               text=True, cwd=ROOT)
            if p.returncode:
                print(p.stderr[-2000:], file=sys.stderr)
                sys.exit(p.returncode)
            print("\n".join(p.stdout.splitlines()[:-1]), flush=True)
            out[one] = json.loads(p.stdout.strip().splitlines()[-1])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        card = out["device"].split()[1].lower()  # "NVIDIA H100 80GB HBM3": h100
        with open(os.path.join(a.out, a.name or f"lone_prompt_{card}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
