"""Offline throughput: the same prompts through kvserve and through transformers' generate.

The workload: ``--num-prompts`` prompts (token ids cut from text that ships with Python) with
lengths uniform in [--min-prompt, --max-prompt] and output lengths uniform in
[--min-output, --max-output] (EOS ignored, so every request produces exactly its length).

kvserve gets all requests at once (continuous batching, each request stops at its own length).
transformers' ``generate`` runs them two ways: one request at a time (what ``generate`` does with
concurrent requests when nothing batches them) and in static batches of ``--hf-batch-size``
(left-padded, each batch running to its longest output: its best use for a mixed offline
batch). Both use transformers' own Llama holding exactly kvserve's weights, dense, in the same
dtype. Useful output tokens (what the requests asked for) over wall time is compared. Prints a
table; writes JSON.

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


def load_transformers(llm: LLM, dtype, device):
    """transformers' own LlamaForCausalLM holding exactly kvserve's weights, dense.

    (transformers can load the GGUF itself, but then keeps the 4-bit weights packed and
    dequantizes inside every matmul; dense weights are its fastest configuration.)"""
    from transformers import LlamaConfig, LlamaForCausalLM
    a = llm.engine.arch
    if a.family != "llama":
        raise SystemExit("the transformers baseline here is built for Llama-family shapes")
    common = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                  num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                  max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings)
    rope = dict(a.rope_scaling or {"rope_type": "default"}, rope_theta=a.rope_theta)
    try:  # transformers 5: one rope_parameters dict (theta included)
        cfg = LlamaConfig(rope_parameters=rope, **common)
    except TypeError:  # older releases
        cfg = LlamaConfig(rope_theta=a.rope_theta, rope_scaling=a.rope_scaling, **common)
    # Built in the target dtype (not cast after): a cast would round the RoPE frequency buffer
    # to bf16 too, which transformers' own loading keeps in float32.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    state = {}
    for name, t in llm.engine.runner.model.state_dict().items():
        base = "model." + name if not name.startswith("lm_head") else name
        if ".qkv_proj." in name:
            for part, sl in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, None))):
                state[base.replace("qkv_proj", part)] = t[sl]
        elif ".gate_up_proj." in name:
            i = a.intermediate_size
            state[base.replace("gate_up_proj", "gate_proj")] = t[:i]
            state[base.replace("gate_up_proj", "up_proj")] = t[i:]
        else:
            state[base] = t
    if a.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    # The peer must rotate exactly as kvserve does: compare the RoPE frequencies it built.
    from kvserve.layers.rotary import rope_inv_freq
    ours = rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling).double()
    theirs = hf.model.rotary_emb.inv_freq.detach().double().cpu()
    err = ((ours - theirs).abs() / ours.abs()).max().item()
    if err > 1e-5:
        raise ValueError(f"transformers built different RoPE frequencies (max rel diff {err:.2e}; its rope "
                         f"parameters: {getattr(hf.config, 'rope_parameters', None)})")
    return hf.eval()


def check_same_model(llm: LLM, hf, prompt: list[int], device) -> None:
    """The baseline must be the same model: greedy continuations agree."""
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    agree = sum(a == b for a, b in zip(ours, ref))
    print(f"baseline check: {agree}/8 greedy tokens equal (kvserve {ours}, transformers {ref})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="both engines run in this dtype")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="kvserve's concurrency (requests in flight)")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"], help="kvserve's weight-only format")
    ap.add_argument("--quantization-group-size", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                    help="kvserve's share of the GPU: the transformers peer runs in the same process")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-sequential", action="store_true", help="skip the one-at-a-time transformers run")
    ap.add_argument("--json-out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, show_progress=False,
              quantization=args.quantization, quantization_group_size=args.quantization_group_size)
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
        "dtype": str(dtype), "num_prompts": args.num_prompts, "max_num_seqs": args.max_num_seqs,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": n_out, "kvserve_s": t_kv, "kvserve_out_tok_s": n_out / t_kv,
        "kv_waste_mean": llm.stats.mean_kv_waste,
    }
    if not args.skip_transformers:
        hf = load_transformers(llm, dtype, device)
        check_same_model(llm, hf, prompts[0], device)
        run_transformers(hf, prompts[:2], [4, 4], 2, device)
        for label, bsz in (("sequential", 1), ("batched", args.hf_batch_size)):
            if label == "sequential" and args.skip_sequential:
                continue
            t_hf = run_transformers(hf, prompts, outputs, bsz, device)
            result[f"transformers_{label}_s"] = t_hf
            result[f"transformers_{label}_out_tok_s"] = n_out / t_hf
            result[f"speedup_vs_{label}"] = t_hf / t_kv
        result["hf_batch_size"] = args.hf_batch_size
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nworkload: {args.num_prompts} prompts, kvserve {args.max_num_seqs} in flight, "
          f"{result['prompt_tokens']} prompt tokens, {n_out} output "
          f"tokens ({args.min_output}-{args.max_output} each), {result['device']}, {dtype}")
    print(f"{'engine':<28}{'time (s)':>10}{'output tok/s':>14}")
    print(f"{'kvserve':<34}{t_kv:>10.2f}{n_out / t_kv:>14.1f}")
    for label, name in (("sequential", "transformers generate, 1 at a time"),
                        ("batched", f"transformers generate, batch {args.hf_batch_size}")):
        if f"transformers_{label}_s" in result:
            print(f"{name:<34}{result[f'transformers_{label}_s']:>10.2f}"
                  f"{result[f'transformers_{label}_out_tok_s']:>14.1f}   kvserve is "
                  f"{result[f'speedup_vs_{label}']:.2f}x")
    print(f"kvserve KV waste (time-averaged): {result['kv_waste_mean']:.2%}")


if __name__ == "__main__":
    main()
