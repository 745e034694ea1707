"""Resume a session: time to first token when its prefix comes back from the CPU tier, from the
disk tier, or is recomputed, at several context lengths; and what the cost model chose.

    PYTHONPATH=$PWD python benchmarks/kvtier_resume.py --out $OUT                      # GPU, 8B shape
    python benchmarks/kvtier_resume.py --model dummy:tiny --lengths 256,1024 --out /tmp/r   # CPU smoke

For each length L: a fresh L-token prompt is run once (recompute: TTFT of a cold prompt), its
KV is written to the tiers (``flush_kv_to_tiers``) and dropped from the GPU prefix cache, then the
same prefix with a new last token is sent again:
  forced CPU   the CPU tier holds it; the cost model is told loading is free (shows the load time)
  auto CPU     the cost model decides (tokens loaded vs recomputed are recorded)
  forced disk  the CPU tier is emptied first, so the chunks come from disk
Writes a JSON file and a plot of TTFT against length with the crossover marked.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def drop_gpu_cache(llm: LLM) -> None:
    llm.engine.kv.pool.reset_prefix_cache()


def empty_cpu_tier(store) -> None:
    if store.cpu is not None:
        with store.cpu.lock:
            store.cpu.chunks.clear()
            store.cpu.pins.clear()
            store.cpu.used = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--kv-memory", default="24GiB")
    ap.add_argument("--cpu-kv-memory", default="24GiB")
    ap.add_argument("--out", default="benchmarks/results/kvtier")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    disk = tempfile.mkdtemp(prefix="kvtier-")
    cuda = torch.cuda.is_available()
    llm = LLM(args.model, dtype="bfloat16" if cuda else "float32", kv_cache_memory=args.kv_memory,
              max_model_len=max(lengths) + 64, max_num_batched_tokens=8192, max_num_seqs=16,
              cpu_kv_memory=args.cpu_kv_memory, disk_kv_dir=disk, disk_kv_size="200GiB", show_progress=False)
    store = llm.engine.store
    rng = random.Random(0)
    vocab = llm.engine.arch.vocab_size
    warm = [rng.randrange(vocab) for _ in range(256)]
    ttft(llm, warm)
    rows = []
    for L in lengths:
        prefix = [rng.randrange(vocab) for _ in range(L)]
        t_re, o = ttft(llm, prefix + [1])
        assert o.metrics.num_loaded_tokens == 0 and o.metrics.num_cached_tokens == 0
        t0 = time.perf_counter()
        llm.engine.flush_kv_to_tiers()
        t_store = time.perf_counter() - t0
        drop_gpu_cache(llm)
        # forced CPU: loading declared free, so the run loads whatever the tier holds
        saved_bw = dict(store.cost.bandwidth)
        store.cost.bandwidth["cpu"] = 1e18
        t_cpu, o_cpu = ttft(llm, prefix + [2])
        store.cost.bandwidth.update(saved_bw)
        drop_gpu_cache(llm)
        t_auto, o_auto = ttft(llm, prefix + [3])
        drop_gpu_cache(llm)
        empty_cpu_tier(store)
        store.cost.bandwidth["disk"] = 1e18
        t_disk, o_disk = ttft(llm, prefix + [4])
        store.cost.bandwidth.update(saved_bw)
        drop_gpu_cache(llm)
        row = {"length": L, "ttft_recompute": t_re, "ttft_cpu": t_cpu, "ttft_disk": t_disk, "ttft_auto": t_auto,
               "loaded_cpu": o_cpu.metrics.num_loaded_tokens, "loaded_disk": o_disk.metrics.num_loaded_tokens,
               "auto_loaded": o_auto.metrics.num_loaded_tokens, "store_seconds": t_store,
               "auto_chose_load": o_auto.metrics.num_loaded_tokens > 0,
               "load_was_faster": t_cpu < t_re}
        row["auto_correct"] = row["auto_chose_load"] == row["load_was_faster"]
        rows.append(row)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kvtier_resume.json"), "w") as f:  # after every length
            json.dump({"rows": rows}, f, indent=1, default=str)
        print(f"L={L:6d}  recompute {t_re * 1e3:8.1f} ms  cpu {t_cpu * 1e3:8.1f} ms ({t_re / t_cpu:5.1f}x, "
              f"{row['loaded_cpu']} loaded)  disk {t_disk * 1e3:8.1f} ms ({row['loaded_disk']} loaded)  "
              f"auto {t_auto * 1e3:8.1f} ms (loaded {row['auto_loaded']}, correct={row['auto_correct']})", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows,
              "tiers": store.snapshot()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kvtier_resume.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["length"] for r in rows]
        for key, label in (("ttft_recompute", "recompute"), ("ttft_cpu", "load from CPU tier"),
                           ("ttft_disk", "load from disk tier")):
            ax.plot(xs, [r[key] * 1e3 for r in rows], marker="o", label=label)
        for r in rows:
            if r["auto_chose_load"]:
                ax.axvline(r["length"], color="grey", alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("Resume a session (shaded: cost model chose to load)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "kvtier_resume.png"), dpi=120)
    except Exception as e:  # the numbers matter more than the picture
        print("plot failed:", e)
    shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
