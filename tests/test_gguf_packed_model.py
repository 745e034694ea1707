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
        ids = packed.get_tokenizer().encode(f.read())[:48]
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


def _copy_with_q8_0_values(src: str, dst: str) -> None:
    """The GGUF file ``src`` written again with every ``attn_v`` tensor requantized to Q8_0 from its
    own values (``gguf``'s quantizer), the rest byte for byte: llama.cpp's kind of mix, a fused
    q/k/v projection of two types."""
    import gguf
    import numpy as np
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
    for field in r.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    data = {}
    for t in r.tensors:
        if t.name.endswith("attn_v.weight"):
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            data[t.name] = (gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                            gguf.GGMLQuantizationType.Q8_0)
        else:
            data[t.name] = (np.asarray(t.data), t.tensor_type)
        arr, qtype = data[t.name]
        w.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(data[t.name][0])
    w.close()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    """The default model's file with Q8_0 ``attn_v`` tensors (``_copy_with_q8_0_values``)."""
    from kvserve.models.loader import default_model_path
    path = str(tmp_path_factory.mktemp("mixed") / "mixed.gguf")
    _copy_with_q8_0_values(default_model_path(), path)
    return path


@pytest.mark.slow
def test_mixed_type_projection_packed_equals_dequantized_at_load(mixed_gguf):
    """A file whose q/k/v parts differ in type (Q4_1 q and k, Q8_0 v) keeps them packed, in one
    group-wise int8 layout, and computes what dequantizing at load computes."""
    kw = dict(model=mixed_gguf, show_progress=False, kv_cache_memory="64MiB", max_model_len=512)
    packed, floats = LLM(quantization="gguf", **kw), LLM(quantization="none", **kw)
    for layer in packed.engine.runner.model.layers:
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, QuantLinear) and qkv.fmt == "gguf Q4_1+Q4_1+Q8_0" and qkv.method == "int8"
        assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.fmt == "gguf Q4_1"
    with open(HELDOUT) as f:
        ids = packed.get_tokenizer().encode(f.read())[:48]
    a, b = _logits(packed, ids), _logits(floats, ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", {"prompt_token_ids": ids[:40]}]
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in floats.generate(prompts, sp)]


@pytest.mark.slow
def test_bfloat16_keeps_4_bit_blocks_packed_by_default(mixed_gguf):
    """Without ``quantization``, a CPU engine in bfloat16 keeps the 4-bit blocks packed (the
    int4 kernel reads a third of bfloat16's bytes) and dequantizes a projection with an 8-bit
    part (the CPU's group-wise int8 path rebuilds float tiles at every product); in float32, the
    reference mode, nothing stays packed. The packed engine's logits stay within bfloat16's
    rounding of the dequantized one's."""
    kw = dict(model=mixed_gguf, show_progress=False, kv_cache_memory="64MiB", max_model_len=512)
    packed, floats = LLM(dtype="bfloat16", **kw), LLM(dtype="bfloat16", quantization="none", **kw)
    assert LLM(dtype="float32", **kw).engine.runner.packed_weights == frozenset()
    layers = packed.engine.runner.model.layers
    assert len(packed.engine.runner.packed_weights) == 4 * len(layers)  # o, gate, up, down
    for layer in layers:
        assert type(layer.self_attn.qkv_proj) is Linear  # Q4_1 q, k with a Q8_0 v
        for mod in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(mod, QuantLinear) and mod.method == "int4" and mod.fmt == "gguf Q4_1"
    with open(HELDOUT) as f:
        ids = packed.get_tokenizer().encode(f.read())[:96]
    a, b = _logits(packed, ids).double(), _logits(floats, ids).double()
    assert ((a - b).norm() / b.norm()).item() < 0.03
    assert (a.argmax(-1) == b.argmax(-1)).double().mean().item() >= 0.9
