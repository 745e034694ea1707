"""CPU projections packed for oneDNN (layers/linear.py): the product equals ``F.linear`` on the
dense weight, for every row count a step can have; packing only reorders (the dense weight comes
back exactly); a copy of a packed model is packed and independent; a CPU engine packs its decoder
projections and its output head (a tied head as a packed copy beside the embedding the lookups
read); quantizing a packed model quantizes its dense weights."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.config import KernelConfig, QuantConfig
from kvserve.layers.linear import (
    Linear,
    cpu_bf16_native,
    cpu_packing_available,
    dense_parameters,
    head_logits,
    pack_cpu_weights,
    unpack_cpu_weights,
)
from kvserve.layers.quant_linear import QuantLinear, quantize_model
from kvserve.layers.weight_init import Embedding

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="this PyTorch build has no oneDNN")


def _model(seed: int = 0, bias: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    m.qkv_proj = Linear(96, 160, bias=bias)
    m.down_proj = Linear(160, 96, bias=bias)
    m.lm_head = Linear(96, 300, bias=False)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16, 17, 64])
def test_packed_product_equals_dense(rows, bias):
    m = _model(rows, bias)
    dense = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert pack_cpu_weights(m) == 3
    assert m.qkv_proj.packed is not None and m.qkv_proj.weight.numel() == 0
    assert m.lm_head.packed is not None and m.lm_head.weight.numel() == 0
    x = torch.randn(rows, 96) + 0.5
    ref = F.linear(x, dense["qkv_proj.weight"], dense.get("qkv_proj.bias"))
    torch.testing.assert_close(m.qkv_proj(x), ref, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 160)
    torch.testing.assert_close(m.down_proj(x3), F.linear(x3, dense["down_proj.weight"], dense.get("down_proj.bias")),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_head_packed_equals_dense(tied, dtype):
    """The output head through its packed weight computes ``F.linear`` on the dense one, tied to
    the embedding (a packed copy; the embedding's rows stay dense for the lookups) or not; a deep
    copy packs its own; unpacking drops the copy."""
    if dtype == torch.bfloat16 and not cpu_bf16_native():
        pytest.skip("this CPU has no native bfloat16 products: bfloat16 is left unpacked")
    torch.manual_seed(5)
    m = nn.Module()
    m.embed_tokens = Embedding(300, 96)
    m.lm_head = None if tied else Linear(96, 300, bias=False)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    m.to(dtype)
    w = (m.embed_tokens if tied else m.lm_head).weight.detach().clone()
    x = (torch.randn(7, 96) + 0.25).to(dtype)
    dense = head_logits(x, m.embed_tokens, m.lm_head)
    assert pack_cpu_weights(m) == 1
    assert m.embed_tokens.weight.numel() == 300 * 96  # the lookups' rows, packed or not
    got = head_logits(x, m.embed_tokens, m.lm_head)
    ref = F.linear(x.double(), w.double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # float32 accumulation order; bfloat16's rounding of y
    for y in (got, dense):
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()).item() < tol
    c = copy.deepcopy(m)
    assert torch.equal(head_logits(x, c.embed_tokens, c.lm_head), got)
    unpack_cpu_weights(m)
    assert getattr(m.embed_tokens, "packed_head", None) is None and (tied or m.lm_head.packed is None)
    assert torch.equal((m.embed_tokens if tied else m.lm_head).weight, w)


def test_dense_weights_come_back_exactly():
    m = _model(1, bias=True)
    dense = {n: p.detach().clone() for n, p in m.named_parameters()}
    pack_cpu_weights(m)
    got = dict(dense_parameters(m))
    assert got.keys() == dense.keys()
    assert all(torch.equal(got[n], dense[n]) for n in dense)
    assert pack_cpu_weights(m) == 0  # already packed
    unpack_cpu_weights(m)
    assert m.qkv_proj.packed is None
    assert all(torch.equal(p, dense[n]) for n, p in m.named_parameters())


def test_copy_of_a_packed_model_is_packed_and_independent():
    m = _model(2)
    pack_cpu_weights(m)
    c = copy.deepcopy(m)
    x = torch.randn(5, 96)
    assert c.qkv_proj.packed is not None and c.qkv_proj.packed is not m.qkv_proj.packed
    assert torch.equal(c.qkv_proj(x), m.qkv_proj(x))
    unpack_cpu_weights(c)
    with torch.no_grad():
        c.qkv_proj.weight.zero_()
    assert m.qkv_proj(x).abs().sum() > 0


def test_quantizing_a_packed_model_uses_its_dense_weights():
    m = _model(3)
    ref = copy.deepcopy(m)
    pack_cpu_weights(m)
    assert quantize_model(m, QuantConfig("int8")) == 2 and quantize_model(ref, QuantConfig("int8")) == 2
    assert isinstance(m.qkv_proj, QuantLinear)
    x = torch.randn(4, 96)
    assert torch.equal(m.qkv_proj(x), ref.qkv_proj(x))
    assert isinstance(m.lm_head, Linear)  # the output head stays float unless asked


def test_an_int8_head_of_a_packed_model_uses_its_dense_weight():
    m = _model(4)
    ref = copy.deepcopy(m)
    pack_cpu_weights(m)
    quant = QuantConfig("int8", head="int8")
    assert quantize_model(m, quant) == 3 and quantize_model(ref, quant) == 3
    assert isinstance(m.lm_head, QuantLinear)
    x = torch.randn(4, 96)
    assert torch.equal(m.lm_head(x), ref.lm_head(x))


def test_a_cpu_engine_packs_its_projections_and_sleep_mode_does_not():
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB")
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.down_proj.packed is not None
    llm.shutdown()
    asleep = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB", enable_sleep_mode=True)
    assert asleep.engine.runner.model.layers[0].self_attn.qkv_proj.packed is None  # sleep moves weights by name
    asleep.shutdown()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_bfloat16_packed_where_native(rows):
    """bfloat16 projections are packed where oneDNN multiplies bfloat16 natively (and left dense
    elsewhere); packed, the product is F.linear's on the dense bfloat16 weight up to bfloat16
    rounding of the output, and the dense weight comes back exactly."""
    m = _model(rows + 7, bias=True).to(torch.bfloat16)
    dense = {n: p.detach().clone() for n, p in m.named_parameters()}
    native = cpu_bf16_native()
    assert pack_cpu_weights(m) == (3 if native else 0)
    assert (m.qkv_proj.packed is not None) == native and (m.lm_head.packed is not None) == native
    x = (torch.randn(rows, 96) + 0.5).to(torch.bfloat16)
    y = m.qkv_proj(x)
    ref = F.linear(x.double(), dense["qkv_proj.weight"].double(), dense["qkv_proj.bias"].double())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 160)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 8e-3  # bfloat16's rounding of y (2^-8)
    assert all(torch.equal(p, dense[n]) for n, p in dense_parameters(m))


def test_a_bfloat16_cpu_engine_packs_where_native():
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB", dtype="bfloat16")
    layer = llm.engine.runner.model.layers[0]
    assert (layer.mlp.down_proj.packed is not None) == cpu_bf16_native()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_on_the_cpu_is_bfloat16_where_native(monkeypatch, native):
    """``dtype="auto"`` runs a CPU engine in bfloat16 where the CPU multiplies it natively and in
    float32 elsewhere (where bfloat16 is emulated); the environment variable fixes either."""
    import kvserve.layers.linear as linear_mod
    monkeypatch.setattr(linear_mod, "cpu_bf16_native", lambda: native)
    monkeypatch.setenv("KVSERVE_CPU_DTYPE", "auto")
    # Unpacked: the patched answer must not make a CPU without bfloat16 pack bfloat16 weights.
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB",
              kernel=KernelConfig(cpu_packed_weights=False))
    assert llm.engine.runner.dtype == (torch.bfloat16 if native else torch.float32)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == llm.engine.runner.dtype
    llm.shutdown()
    for fixed, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setenv("KVSERVE_CPU_DTYPE", fixed)
        llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB",
                  kernel=KernelConfig(cpu_packed_weights=False))
        assert llm.engine.runner.dtype == dtype and llm.engine.runner.model.embed_tokens.weight.dtype == dtype
        llm.shutdown()
    # An explicit dtype wins over the variable.
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB", dtype="float32")
    assert llm.engine.runner.dtype == torch.float32
    llm.shutdown()


def test_a_bad_cpu_dtype_variable_is_refused_by_name(monkeypatch):
    from kvserve.errors import ConfigError
    for bad in ("fp32", "float16", "BFLOAT16 "):
        monkeypatch.setenv("KVSERVE_CPU_DTYPE", bad)
        with pytest.raises(ConfigError, match="KVSERVE_CPU_DTYPE.*must be auto, float32 or bfloat16"):
            LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB")
