"""Parity against transformers on small random Qwen2 (QKV bias) and Qwen3 (q/k norm) models,
saved as Hugging Face directories (config.json + safetensors) and loaded by kvserve."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy

N_NEW = 16


def _make(tmp_path, kind: str, layers: int = 3, seed: int = 0, **config):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1023,
                  bos_token_id=1022)
    common.update(config)
    if kind == "qwen2":
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        cfg, cls = Qwen3Config(head_dim=32, **common), Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random, non-zero, and far from uniform logits (no near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.3)
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


# The backend sees q, k and v after the model's QKV bias (Qwen2) and q/k norm (Qwen3): each model
# runs on the torch backend, and Qwen3 also on the Triton one.
@pytest.mark.parametrize("kind,backend", [("qwen2", "torch"), ("qwen3", "torch"),
                                          pytest.param("qwen3", "triton", marks=pytest.mark.slow)])
def test_random_qwen_matches_transformers(tmp_path, kind, backend):
    """``triton``: the engine's Triton backend (fused RoPE + KV write, paged prefill over chunks
    and decode kernels), in Triton's interpreter when there is no GPU, on two layers (the second
    checks each layer's offsets into the cache; a third would only repeat the interpreter's work)."""
    model, path = _make(tmp_path, kind, layers=2 if backend == "triton" else 3)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    else:
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    gen = torch.Generator().manual_seed(1)
    # Every prompt length class: one token, within a block, across blocks, across chunks (three
    # chunks for the longest). Shorter in Triton's interpreter, where each token costs far more.
    lengths, chunk = ((1, 7, 33, 120, 300), 128) if backend == "torch" else ((1, 7, 33, 150), 64)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]
    want = [hf_greedy(model, p, N_NEW, eos_token_id=None) for p in prompts]
    llm = LLM(path, show_progress=False, kv_cache_memory="64MiB", block_size=8, max_num_batched_tokens=chunk,
              attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    assert llm.engine.arch.family == kind
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, o, w in zip(prompts, outs, want, strict=True):
        assert o.outputs[0].token_ids == w, f"{kind}, prompt of {len(p)} tokens"
    assert llm.engine.kv.pool.num_used_blocks == 0
