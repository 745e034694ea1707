"""The same engine on CUDA (skipped without a GPU): parity with transformers on random small
models in float32, KV sizing by profiling free memory in bfloat16, snapshots and sleep mode."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import KernelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _random_model(tmp_path, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "llama":
        cfg, cls = LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                               rope_theta=500000.0, **common), LlamaForCausalLM
    else:
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08 if p.dim() > 1 else 0.3)
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return model.cuda(), str(path)


@pytest.mark.parametrize("fused", [False, True], ids=["rope_kv_write", "fused_rope_decode"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_parity_float32(tmp_path, kind, fused):
    """fused_rope_decode: decode steps with the RoPE + KV write done inside the decode attention
    kernel (``KernelConfig.fused_rope_decode``)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, path = _random_model(tmp_path, kind)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (1, 17, 200, 700, 1500)]
    # The reference is transformers' forward, re-run over the whole sequence for each token:
    # its generate() disagrees with its own forward for llama3-scaled RoPE past the original
    # context (seen with transformers 5.17 on a 1,500-token prompt), so it is not used here.
    want = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(64):
                seq.append(int(hf(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
            want.append(seq[len(p):])
    llm = LLM(path, device="cuda", dtype="float32", show_progress=False, kv_cache_memory="1GiB",
              max_num_batched_tokens=512, kernel=KernelConfig(fused_rope_decode=fused))
    assert llm.engine.runner.backend.kernel.fused_rope_decode is fused
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, o, w in zip(prompts, outs, want):
        assert o.outputs[0].token_ids == w, f"{kind}: prompt of {len(p)} tokens"
    # One request alone decodes one row a step: the skinny-GEMM products replayed from the
    # batch-1 graph
    for i in (0, 3):
        o = llm.generate([{"prompt_token_ids": prompts[i]}], SamplingParams(max_tokens=64, temperature=0,
                         ignore_eos=True), use_tqdm=False)[0]
        assert o.outputs[0].token_ids == want[i], f"{kind} alone: prompt of {len(prompts[i])} tokens"
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_kivi_int4_decode_fused_write_same_tokens(tmp_path):
    """int4 KV in a bfloat16 model with heads of 128 (the Gluon decode kernel's): greedy decode with
    the RoPE + KV write inside the decode kernel gives the same tokens as with the separate
    quantizing write kernel (they write the same bytes: ``test_kivi_decode``), through CUDA graphs,
    over decode steps that seal blocks; every block is freed after."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.05 if p.dim() > 1 else 0.3)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (1, 63, 64, 130, 700)]
    got = {}
    for fused in (False, True):
        llm = LLM(str(tmp_path / "m"), device="cuda", dtype="bfloat16", show_progress=False, kv_cache_memory="1GiB",
                  kv_cache_dtype="int4", block_size=64, max_num_batched_tokens=512,
                  kernel=KernelConfig(fused_rope_decode=fused))
        assert llm.engine.runner.graphs is not None and llm.engine.runner.backend.kernel.fused_rope_decode is fused
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=80, temperature=0, ignore_eos=True), use_tqdm=False)
        got[fused] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.kv.pool.num_used_blocks == 0
        del llm
    assert got[True] == got[False]


def test_cuda_kv_sized_from_free_memory():
    llm = LLM("dummy:smollm2-135m", device="cuda", show_progress=False, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    kv_bytes = llm.engine.runner.kv_cache.nbytes
    assert llm.engine.runner.dtype == torch.bfloat16
    # Half of the card minus weights and activations: most of it becomes KV pages.
    assert 0.3 * total < kv_bytes < 0.5 * total
    outs = llm.generate([{"prompt_token_ids": list(range(1, 100))}] * 4,
                        SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:tiny-gemma3"], ids=["gqa", "gemma3-window"])
def test_verify_steps_replay_decode_graphs(model):
    """Speculative verify steps run as decode rows replaying the decode CUDA graphs
    (``engine/decode_rows.py``): their logits match the eager prefill-shaped step's, and greedy
    n-gram speculation through them is token-identical to the prefill-shaped verify's."""
    import numpy as np
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model, device="cuda", dtype="float32", show_progress=False, kv_cache_memory="256MiB",
              speculative_config=spec)
    rt = llm.engine.runner
    assert rt.graphs is not None and rt.graphs.max_batch >= 128  # the policy's largest verify step
    replays = []
    run = rt.graphs.run
    rt.graphs.run = lambda ids, *a, **kw: replays.append(len(ids)) or run(ids, *a, **kw)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(llm.engine.num_kv_blocks).tolist()
    with torch.inference_mode():
        for B, q in ((1, 2), (1, 5), (3, 4), (8, 5), (30, 4)):
            seqs = []
            for _ in range(B):
                ctx = int(rng.integers(1, 300))
                seqs.append((ctx, q, [blocks.pop() for _ in range(-(-(ctx + q) // rt.block_size))]))
            rt._forward(rng.integers(1, 500, sum(c for c, _, _ in seqs)).tolist(), [(0, c, t) for c, _, t in seqs])
            ids = rng.integers(1, 500, B * q).tolist()
            want = rt._logits(rt._forward(ids, seqs, rows=False)[0]).clone()
            n = len(replays)
            got = rt._logits(rt._forward(ids, seqs)[0])
            assert replays[n:] == [B * q], "the verify step did not replay a graph"
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            blocks.extend(b for _, _, t in seqs for b in t)
    prompts = [[int(x) for x in rng.integers(1, 500, 12)] * 3 for _ in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = {}
    for mode in ("graphs", "never"):
        llm = LLM(model, device="cuda", dtype="float32", show_progress=False, kv_cache_memory="256MiB",
                  speculative_config=spec, kernel=KernelConfig(decode_rows=mode))
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats.spec.spec_decode_num_accepted_tokens > 0
        assert llm.engine.kv.pool.num_used_blocks == 0
        del llm
    assert outs["graphs"] == outs["never"]


def test_cuda_snapshot_and_sleep_same_tokens_and_memory_back(tmp_path, monkeypatch):
    """A bf16 snapshot (pinned staging, async copies, checksum blocks that cut tensors, the
    device warm-up beside the load) gives the HF directory's tokens, with CUDA graphs; sleep at
    both levels gives the memory of the weights, KV pool and graphs back to the driver
    (mem_get_info, not the allocator's count) and the same tokens after the wake."""
    from kvserve.models import snapshot
    hf, path = _random_model(tmp_path, "llama")
    del hf  # the reference model stays off the GPU whose memory is counted
    kw = dict(dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=8, show_progress=False)
    prompts = [[5, 77, 300, 12, 9, 41], list(range(100, 140))]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    src = LLM(path, **kw)
    ref = [o.outputs[0].token_ids for o in src.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(snapshot, "HASH_BLOCK_BYTES", (1 << 20) + 7)
    snapshot.write(src.engine, str(tmp_path / "snap"))
    del src
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path / "snap"), enable_sleep_mode=True, **kw)
    assert llm.engine.runner.graphs is not None
    assert "device_warmup" in llm.engine.startup_seconds and "triton_key" in llm.engine.startup_seconds
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    torch.cuda.synchronize()
    used_awake = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    for level in (1, 2, 1, 2):
        llm.sleep(level)
        if level == 1:  # the host copy is page-locked, so the copies back run asynchronously
            host = llm.engine.runner.sleep_mode._host
            assert host.registered and host.tensor.is_pinned()
        used_asleep = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        assert used_awake - used_asleep >= 2**30  # at least the KV pool, whatever else shares the GPU
        assert torch.cuda.memory_reserved() < 64 * 2**20
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref


def test_sleep_host_copy_falls_back_to_a_pinned_allocation(monkeypatch):
    """A registration the driver refuses leaves a pinned copy of the same size and no error
    behind for the next kernel launch; a registration it accepts is page-locked."""
    from kvserve.engine import sleep_mode
    real = torch.cuda.cudart()

    class Refusing:
        def cudaHostRegister(self, *args):
            return 2  # cudaErrorMemoryAllocation

        def __getattr__(self, name):
            return getattr(real, name)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    fallback = sleep_mode.HostCopy(64 << 20, torch.device("cuda"))
    assert not fallback.registered and fallback.tensor.is_pinned() and fallback.tensor.numel() == 64 << 20
    assert float(torch.ones(8, device="cuda").sum()) == 8.0
    monkeypatch.undo()
    copy = sleep_mode.HostCopy(64 << 20, torch.device("cuda"))
    assert copy.registered and copy.tensor.is_pinned()
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    copy.tensor[:4 << 20].view(torch.float32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(copy.tensor[:4 << 20].view(torch.float32), src.cpu())
    del copy, fallback


def test_first_requests_compile_no_triton_kernel():
    """Start-up compiles what eager steps need (``engine/eager_warmup.py``): after it, batches of
    prompts of mixed lengths, a cached prefix, verify steps and a draft model's catch-up steps
    meet only kernels already compiled."""
    import triton
    compiled = []

    def hook(**kw):
        compiled.append(kw["fn"].name)
        return False  # compile as usual

    llm = LLM("dummy:tiny", device="cuda", dtype="bfloat16", show_progress=False, kv_cache_memory="256MiB",
              speculative_config={"method": "draft_model", "model": "dummy:tiny-draft", "num_speculative_tokens": 3})
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 500, (40,), generator=gen).tolist()
    batches = [[n] for n in (1, 7, 300)] + [[3, 90], [16, 17, 33, 64, 65, 200], [5] * 40, [700, 2, 129]]
    before = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        for lens in batches:
            prompts = [shared + torch.randint(0, 500, (n,), generator=gen).tolist() for n in lens]
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = before
    assert llm.stats.spec.spec_decode_num_drafts > 0
    assert compiled == [], f"compiled after start-up: {sorted(set(compiled))}"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_output_head_every_product_and_graphs(method):
    """An int8 output head on CUDA, in bfloat16 (dummy SmolLM2-135M: a 49,152-row head tied to the
    embedding): at 1 to 300 rows of x (the one-row kernel, the skinny kernel, the tiled GEMM,
    dequantize-then-cuBLAS; at Llama-3-8B's head shape the weight-left GEMM too) its product
    equals x times the head dequantized in plain PyTorch in float32, within bfloat16's rounding;
    the embedding lookups keep the float table; greedy decoding through CUDA graphs gives the
    eager engine's tokens."""
    from kvserve.config import QuantConfig
    from kvserve.kernels.wq_gemm import dequantize_ref
    from kvserve.layers.quant_linear import QuantLinear
    kw = dict(device="cuda", dtype="bfloat16", show_progress=False, kv_cache_memory="256MiB", quantization=method,
              quantization_group_size=64 if method == "int4" else None, quantization_head="int8")
    llm = LLM("dummy:smollm2-135m", **kw)
    model = llm.engine.runner.model
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.method == "int8" and head.qweight.dtype == torch.int8
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    w = dequantize_ref(head.qweight, head.scales).float()
    assert w.shape == model.embed_tokens.weight.shape
    emb = model.embed_tokens.weight.float()
    assert ((w - emb).norm() / emb.norm()).item() < 0.02  # the head is the table, rounded to int8
    # And Llama-3-8B's head (K = 4,096: the weight-left GEMM takes 64 to 256 rows), as
    # ``quantization_head`` builds it from a float head.
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.nn.Linear(4096, 128256, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        big.weight.normal_(0.0, 0.02, generator=gen)
    big = QuantLinear.from_linear(big, QuantConfig("int8"))
    with torch.inference_mode():
        for layer, w_ref in ((head, w), (big, dequantize_ref(big.qweight, big.scales).float())):
            for rows in (1, 5, 40, 100, 300):
                x = torch.randn(rows, w_ref.shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
                want = x.float() @ w_ref.T
                got = layer(x).float()
                assert ((got - want).norm() / want.norm()).item() < 1e-2, (layer.out_features, rows)
    prompts = [[int(t) for t in torch.randint(1, 40000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 60)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.runner.graphs is not None
    eager = LLM("dummy:smollm2-135m", enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == graphs
