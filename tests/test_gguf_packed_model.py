"""The default model (SmolLM2-135M, its projections Q4_1 in the GGUF file) loads with its blocks
packed (``quantization="gguf"``) and computes what the dequantize-at-load path
(``quantization="none"``) computes: prompt logits over a held-out text within 1e-4 relative L2
error (float32 rounding: the CPU int4 kernel adds (q - 8) * scale and min + 8 * scale where the
file's blocks define q * scale + min), the same top-1 token everywhere, the same greedy text."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import QuantConfig
from kvserve.errors import ConfigError
from kvserve.layers.linear import Linear
from kvserve.layers.quant_linear import QuantLinear

HELDOUT = os.path.join(os.path.dirname(__file__), "data", "heldout_en.txt")


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.engine.runner
    with torch.inference_mode():
        return runner.model.compute_logits(runner.hidden_states(ids))


@pytest.mark.slow
def test_default_model_packed_equals_dequantized_at_load():
    packed = LLM(show_progress=False, kv_cache_memory="64MiB", max_model_len=512, quantization="gguf")
    floats = LLM(show_progress=False, kv_cache_memory="64MiB", max_model_len=512, quantization="none")
    layers = packed.engine.arch.num_layers
    assert len(packed.engine.runner.packed_weights) == 7 * layers  # q, k, v, o, gate, up, down
    for layer in packed.engine.runner.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(mod, QuantLinear) and mod.fmt == "gguf Q4_1"
        assert not any(p.dim() == 2 for p in layer.parameters())
    assert isinstance(floats.engine.runner.model.layers[0].mlp.down_proj, Linear)
    assert floats.engine.runner.packed_weights == frozenset()

    with open(HELDOUT) as f:
        ids = packed.get_tokenizer().encode(f.read())[:96]
    a, b = _logits(packed, ids), _logits(floats, ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    prompts = ["The capital of France is", {"prompt_token_ids": ids[:40]}]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out_a = [o.outputs[0].token_ids for o in packed.generate(prompts, sp)]
    out_b = [o.outputs[0].token_ids for o in floats.generate(prompts, sp)]
    assert out_a == out_b and all(len(t) == 8 for t in out_a)


def test_none_takes_no_group_size():
    with pytest.raises(ConfigError) as e:
        QuantConfig("none", 32)
    assert e.value.option == "quantization_group_size"
