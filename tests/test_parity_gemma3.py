"""Parity against transformers' Gemma3ForCausalLM on small random Gemma 3 models saved as Hugging
Face directories: local layers with a window of 16-24 keys and global ones, GQA and MQA, prompts
several windows long, in one batch, over chunks and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy

N_NEW = 12


LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")


def make_gemma3(tmp_path, window: int, kv_heads: int, layer_types=LAYERS, **extra):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=kv_heads,
                           head_dim=32, max_position_embeddings=2048, sliding_window=window, query_pre_attn_scalar=24,
                           layer_types=list(layer_types),
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                           eos_token_id=1, bos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-zero, far from uniform logits (no near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.3)
    path = tmp_path / "gemma3"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def prompts_of(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]


# triton: the engine's Triton backend (the window kernels, the fused RoPE + KV write), in
# Triton's interpreter when there is no GPU; there on one local and one global layer (each
# kernel and each layer's offsets into the cache; more layers only repeat the interpreter's work).
@pytest.mark.parametrize("window,kv_heads,softcap,backend", [
    (16, 2, None, "torch"), (24, 1, None, "torch"), (16, 2, 2.0, "torch"),
    pytest.param(16, 1, None, "triton", marks=pytest.mark.slow)])
def test_random_gemma3_matches_transformers(tmp_path, window, kv_heads, softcap, backend):
    layer_types = LAYERS if backend == "torch" else LAYERS[:2]
    model, path = make_gemma3(tmp_path, window, kv_heads, layer_types, final_logit_softcapping=softcap)
    # Under Triton's interpreter every kernel runs in Python: there, prompts up to about four
    # windows (the windows' tiles, the chunk boundaries and the prefix hits all still occur).
    lengths = (1, 7, 15, 16, 17, 40, 100, 203) if backend == "torch" else (1, 7, 17, 40, 70)
    prompts = prompts_of(lengths)
    want = [hf_greedy(model, p, N_NEW, eos_token_id=None) for p in prompts]
    llm = LLM(path, show_progress=False, kv_cache_memory="64MiB", block_size=8, max_num_batched_tokens=64,
              enable_prefix_caching=True, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    arch = llm.engine.arch
    assert arch.family == "gemma3"
    assert arch.layer_windows == tuple(window if t == "sliding_attention" else None for t in layer_types)
    if softcap is not None:  # the logits kvserve returns are capped as transformers' are
        with torch.no_grad():
            hf_logits = model(torch.tensor([prompts[-1]])).logits[0, -1]
        assert hf_logits.max() > 0.8 * softcap  # the cap bends the top logits
        got = llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=1, logprobs=5, temperature=0),
                           use_tqdm=False)[0].outputs[0].logprobs[0]
        want_lp = hf_logits.log_softmax(-1)
        for tok, lp in got.items():
            assert abs(lp.logprob - want_lp[tok].item()) < 1e-4
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o, w in zip(prompts, outs, want, strict=True):
            assert o.outputs[0].token_ids == w, f"prompt of {len(p)} tokens"
        llm.engine.check_invariants()
    assert llm.engine.kv.prefix_hits > 0
    if backend == "triton":  # a lone whole prompt longer than the window: the prefill kernel, not SDPA's
        lone = prompts_of((3 * window + 5,), seed=2)[0]
        out = llm.generate([{"prompt_token_ids": lone}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(model, lone, N_NEW, eos_token_id=None)
    assert llm.engine.kv.pool.num_used_blocks == 0


GEMMA3_CFG = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 1024, "sliding_window": 8}


@pytest.mark.unit
def test_gemma3_config_layer_pattern():
    from kvserve.models.arch import ModelArch
    arch = ModelArch.from_hf_config(GEMMA3_CFG)  # no layer_types: every sixth layer global
    assert arch.layer_windows == (8, 8, 8, 8, 8, None, 8)
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 1e4, 16.0)
    arch = ModelArch.from_hf_config({**GEMMA3_CFG, "sliding_window_pattern": 2, "rope_local_base_freq": 500.0,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert arch.layer_windows == (8, None, 8, None, 8, None, 8) and arch.rope_local_theta == 500.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # A window as long as the context: no key ever leaves it.
    assert ModelArch.from_hf_config({**GEMMA3_CFG, "sliding_window": 1024}).layer_windows == (None,) * 7


@pytest.mark.parametrize("change,field", [
    ({"sliding_window": 0}, "sliding_window"), ({"sliding_window": -4}, "sliding_window"),
    ({"sliding_window": 2 ** 63}, None), ({"sliding_window": "512"}, "sliding_window"),
    ({"sliding_window": True}, "sliding_window"), ({"sliding_window": 8.5}, "sliding_window"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 6 + ["chunked_attention"]}, "chunked_attention"),
    ({"layer_types": "full_attention"}, "layer_types"),
    ({"query_pre_attn_scalar": float("nan")}, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping"),
    ({"final_logit_softcapping": float("inf")}, "final_logit_softcapping"),
    ({"rope_parameters": ["full_attention"]}, "rope_parameters"),
    ({"num_hidden_layers": None}, "num_hidden_layers"), ({"num_hidden_layers": "7"}, "num_hidden_layers"),
    ({"max_position_embeddings": "1024"}, "max_position_embeddings"),
    ({"rope_local_base_freq": "1e4"}, "rope_local_base_freq"),
])
@pytest.mark.unit
def test_gemma3_bad_config(change, field):
    """A bad Gemma 3 config fails to load with a message naming the field."""
    from kvserve.errors import ModelLoadError
    from kvserve.models.arch import ModelArch
    cfg = {k: v for k, v in {**GEMMA3_CFG, **change}.items() if v is not None}
    if field is None:  # huge but valid: a window no context reaches
        assert ModelArch.from_hf_config(cfg).layer_windows == (None,) * 7
        return
    with pytest.raises(ModelLoadError, match=field):
        ModelArch.from_hf_config(cfg)
