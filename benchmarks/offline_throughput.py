"""Offline throughput: the same prompts through kvserve and through transformers' generate.

The workload: ``--num-prompts`` prompts (token ids cut from text that ships with Python) with
lengths uniform in [--min-prompt, --max-prompt] and output lengths uniform in
[--min-output, --max-output] (EOS ignored, so every request produces exactly its length).

kvserve gets all requests at once (continuous batching, each request stops at its own length).
transformers' ``generate`` gets them in batches of ``--hf-batch-size`` (left-padded), each batch
running to its longest output, its best use for a mixed offline batch. Useful output tokens
(what the requests asked for) over wall time is compared. Prints a table; writes JSON.

    python benchmarks/offline_throughput.py                      # default model, CPU
    python benchmarks/offline_throughput.py --model dummy:llama-3-8b --device cuda --num-prompts 256
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402


def make_workload(args, vocab_size: int, tokenizer) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    if tokenizer is not None:
        import difflib
        import json as json_mod
        import textwrap
        text = (textwrap.__doc__ or "") + (difflib.__doc__ or "") + (json_mod.__doc__ or "")
        corpus = tokenizer.encode(text * 4)
    else:
        corpus = [rng.randrange(vocab_size) for _ in range(20000)]
    prompts, outputs = [], []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_prompt, args.max_prompt)
        start = rng.randrange(0, len(corpus) - n)
        prompts.append(corpus[start:start + n])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return prompts, outputs


def run_kvserve(llm: LLM, prompts, outputs) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == outputs, "kvserve produced a different number of tokens than asked"
    return dt


def run_transformers(model, prompts, outputs, batch_size: int, device) -> float:
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        ps, os_ = prompts[b:b + batch_size], outputs[b:b + batch_size]
        width = max(map(len, ps))
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for i, p in enumerate(ps):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n_new = max(os_)
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + n_new
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def load_transformers(model: str | None, llm: LLM, dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from kvserve.models.loader import default_model_path
    path = model or default_model_path()
    if path.startswith("dummy:"):  # same shape, random weights: speed depends on shape only
        a = llm.engine.arch
        cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                          num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                          num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                          max_position_embeddings=a.max_position_embeddings,
                          tie_word_embeddings=a.tie_word_embeddings)
        with torch.device(device):
            return LlamaForCausalLM(cfg).to(dtype).eval()
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json-out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, show_progress=False)
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    prompts, outputs = make_workload(args, llm.engine.arch.vocab_size, llm.get_tokenizer())
    n_out = sum(outputs)
    # Warm-up (allocator, kernels), then the timed run.
    run_kvserve(llm, prompts[:2], [4, 4])
    t_kv = run_kvserve(llm, prompts, outputs)
    result = {
        "date": time.strftime("%Y-%m-%d"), "model": args.model or "SmolLM2-135M-Instruct (default)",
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "dtype": str(dtype), "num_prompts": args.num_prompts, "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": n_out, "kvserve_s": t_kv, "kvserve_out_tok_s": n_out / t_kv,
        "kv_waste_mean": llm.stats.mean_kv_waste,
    }
    if not args.skip_transformers:
        hf = load_transformers(args.model, llm, dtype, device)
        run_transformers(hf, prompts[:2], [4, 4], 2, device)
        t_hf = run_transformers(hf, prompts, outputs, args.hf_batch_size, device)
        result.update(transformers_s=t_hf, transformers_out_tok_s=n_out / t_hf, speedup=t_hf / t_kv,
                      hf_batch_size=args.hf_batch_size)
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nworkload: {args.num_prompts} prompts, {result['prompt_tokens']} prompt tokens, {n_out} output "
          f"tokens ({args.min_output}-{args.max_output} each), {result['device']}, {dtype}")
    print(f"{'engine':<28}{'time (s)':>10}{'output tok/s':>14}")
    print(f"{'kvserve':<28}{t_kv:>10.2f}{n_out / t_kv:>14.1f}")
    if "transformers_s" in result:
        print(f"{'transformers generate (b=' + str(args.hf_batch_size) + ')':<28}"
              f"{result['transformers_s']:>10.2f}{result['transformers_out_tok_s']:>14.1f}")
        print(f"kvserve / transformers = {result['speedup']:.2f}x")
    print(f"kvserve KV waste (time-averaged): {result['kv_waste_mean']:.2%}")


if __name__ == "__main__":
    main()
