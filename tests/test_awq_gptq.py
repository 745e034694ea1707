"""AutoAWQ and GPTQ 4-bit checkpoints (``kvserve/models/awq_gptq.py``) on the CPU.

The checkpoints are written here from the formats' own packing conventions (the packers themselves,
AutoAWQ and GPTQModel, need CUDA builds of torch that this machine does not have):

* AutoAWQ, ``awq/modules/linear/gemm.py`` (``WQLinear_GEMM.from_linear``): qweight [K, N/8] and
  qzeros [K/g, N/8] int32, eight output columns a word, column 8c + ORDER[i] in nibble i with
  ORDER = 0 2 4 6 1 3 5 7; scales [K/g, N] float16; w = (q - z) * s.
* GPTQ, AutoGPTQ's ``qlinear_cuda_old.QuantLinear.pack`` (the "gptq" checkpoint format): qweight
  [K/8, N], input row 8r + i in nibble i of row r; qzeros [K/g, N/8], column 8c + i in nibble i,
  storing z - 1; scales [K/g, N]; g_idx [K] the group of each input column (act-order: a
  permutation of k // g).

A ``dummy:tiny``-shaped Llama is quantized (random zero points, so no code is special), written
in each layout and loaded; its logits equal those of the float checkpoint holding the
dequantized weights (float32, relative error < 1e-5), each projection's weight read back through
the layer equals them, and mismatched configs fail naming what is wrong.
"""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, ModelLoadError
from kvserve.layers.quant_linear import QuantLinear
from kvserve.models.presets import DUMMY_PRESETS

CFG = DUMMY_PRESETS["tiny"]
G = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _shapes():
    h, i = CFG["hidden_size"], CFG["intermediate_size"]
    hd = h // CFG["num_attention_heads"]
    kv = CFG["num_key_value_heads"] * hd
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def _pack_words(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8C] codes -> [R, C] int32, column 8c + order[i] in nibble i."""
    c = codes.contiguous().view(codes.shape[0], -1, 8).to(torch.int64)
    word = sum(c[..., order[i]] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # two's complement into int32


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, gen, lowest_zero: int):
    """w [N, K] -> codes [K, N], zeros and scales [K/g, N] (random zero points), dequantized [N, K]."""
    N, K = w.shape
    groups = K // G
    scales = (torch.rand(groups, N, generator=gen) * 0.01 + 0.002).half()
    zeros = torch.randint(lowest_zero, 16, (groups, N), generator=gen)
    s, z = scales.float()[g_idx], zeros[g_idx]  # [K, N]
    q = torch.clamp(torch.round(w.t() / s) + z, 0, 15).to(torch.int64)
    return q, zeros, scales, ((q - z) * s).t()


def _write(tmp, fmt: str, act_order: bool = False, quant_cfg: dict | None = None):
    """(quantized checkpoint dir, float checkpoint dir of the dequantized weights, those weights)."""
    gen = torch.Generator().manual_seed(3)
    float_t, packed_t, deq = {}, {}, {}
    float_t["model.embed_tokens.weight"] = torch.randn(CFG["vocab_size"], CFG["hidden_size"], generator=gen) * 0.5
    float_t["model.norm.weight"] = torch.rand(CFG["hidden_size"], generator=gen) + 0.5
    for layer in range(CFG["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            float_t[f"model.layers.{layer}.{n}.weight"] = torch.rand(CFG["hidden_size"], generator=gen) + 0.5
        for p, (N, K) in _shapes().items():
            name = f"model.layers.{layer}.{p}"
            g_idx = torch.arange(K) // G
            if act_order:  # one column order per input, as GPTQ's (shared by q/k/v and by gate/up)
                g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(layer * 10 + K))]
            w = torch.randn(N, K, generator=gen) * 0.02
            # GPTQ stores z - 1 in a nibble: its zero points are 1..15 (a 0 would borrow from the next)
            q, zeros, scales, wd = _quantize(w, g_idx, gen, 0 if fmt == "awq" else 1)
            deq[name] = wd
            if fmt == "awq":
                packed_t[f"{name}.qweight"] = _pack_words(q, AWQ_ORDER)
                packed_t[f"{name}.qzeros"] = _pack_words(zeros, AWQ_ORDER)
            else:
                packed_t[f"{name}.qweight"] = _pack_words(q.t().contiguous()).t().contiguous()
                packed_t[f"{name}.qzeros"] = _pack_words(zeros - 1)
                packed_t[f"{name}.g_idx"] = g_idx.to(torch.int32)
            packed_t[f"{name}.scales"] = scales
    from safetensors.torch import save_file
    qdir, fdir = tmp / fmt, tmp / f"{fmt}-float"
    qdir.mkdir()
    fdir.mkdir()
    qc = quant_cfg or ({"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
                       if fmt == "awq" else
                       {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": act_order, "sym": False})
    (qdir / "config.json").write_text(json.dumps({**CFG, "quantization_config": qc}))
    (fdir / "config.json").write_text(json.dumps(CFG))
    save_file({**float_t, **packed_t}, str(qdir / "model.safetensors"))
    save_file({**float_t, **{f"{k}.weight": v.contiguous() for k, v in deq.items()}}, str(fdir / "model.safetensors"))
    return qdir, fdir, deq


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.engine.runner
    with torch.inference_mode():
        return runner.model.compute_logits(runner.hidden_states(ids))


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_checkpoint_loads_packed_and_matches_dequantized(tmp_path, fmt, act_order):
    qdir, fdir, deq = _write(tmp_path, fmt, act_order)
    llm = LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")
    ref = LLM(str(fdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")
    layer = llm.engine.runner.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert isinstance(qkv, QuantLinear) and qkv.fmt == fmt and qkv.group_size == G
    assert (qkv.perm is not None) == act_order
    # each projection's weight, read back through the layer (x = identity rows), is the dequantized one
    with torch.inference_mode():
        K = down.in_features
        assert torch.allclose(down(torch.eye(K)).t(), deq["model.layers.0.mlp.down_proj"], rtol=1e-5, atol=1e-7)
        q_rows = torch.cat([deq[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
        assert torch.allclose(qkv(torch.eye(qkv.in_features)).t(), q_rows, rtol=1e-5, atol=1e-7)
    ids = list(range(3, 60))
    a, b = _logits(llm, ids), _logits(ref, ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-5
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert (llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
            == ref.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 8, "group_size": G}, "bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48}, "group_size 48"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32.0}, "group_size 32.0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": True}, "group_size True"),
    ({"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemv"}, "GEMM"),
    ({"quant_method": "gptq", "bits": 4, "group_size": G, "checkpoint_format": "gptq_v2"}, "checkpoint_format"),
    ({"quant_method": "bitsandbytes"}, "not loaded"),
])
def test_bad_configs(tmp_path, qc, match):
    qdir, _, _ = _write(tmp_path, "awq", quant_cfg=qc)
    with pytest.raises(ConfigError, match=match) as e:
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")
    assert e.value.option == "quantization"


@pytest.mark.parametrize("text,match", [("{not json", "quantize_config.json: not valid JSON"),
                                        ("[1, 2]", "quantize_config.json: must be a JSON object")])
def test_a_bad_quantize_config_file_is_a_load_error(tmp_path, text, match):
    """AutoGPTQ's quantize_config.json (read where config.json has no quantization_config) that is
    not a JSON object is refused naming the file."""
    qdir, _, _ = _write(tmp_path, "gptq")
    cfg = json.loads((qdir / "config.json").read_text())
    del cfg["quantization_config"]
    (qdir / "config.json").write_text(json.dumps(cfg))
    (qdir / "quantize_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


@pytest.mark.parametrize("qc,match", [("awq", "quantization_config must be an object"),
                                      (["awq"], "quantization_config must be an object"),
                                      ({"quant_method": ""}, "packed quantized tensor.*no usable quantization_config"),
                                      (None, "packed quantized tensor.*no usable quantization_config")])
def test_a_config_that_does_not_say_how_is_a_load_error(tmp_path, qc, match):
    """Packed tensors under a quantization_config that is not an object, or names no method, are
    refused saying so (not as unexpected weights of the model)."""
    qdir, _, _ = _write(tmp_path, "awq")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


def test_config_and_tensors_disagree(tmp_path):
    """A GPTQ config over AWQ tensors: GPTQ's g_idx is missing."""
    qdir, _, _ = _write(tmp_path, "awq", quant_cfg={"quant_method": "gptq", "bits": 4, "group_size": G})
    with pytest.raises(ModelLoadError, match="gptq.*g_idx is missing"):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


def test_awq_config_over_gptq_tensors(tmp_path):
    """An AWQ config over GPTQ tensors: refused by the layout its qweight has, naming both."""
    qdir, _, _ = _write(tmp_path, "gptq", quant_cfg={"quant_method": "awq", "bits": 4, "group_size": G,
                                                     "zero_point": True, "version": "gemm"})
    with pytest.raises(ModelLoadError, match=r"says awq, whose qweight is \[in_features, out_features / 8\] "
                                             r"\(64 rows here\), but model.layers.0.self_attn.q_proj.qweight is "
                                             r"\(8, 64\); .*g_idx is present"):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


def test_method_must_match_checkpoint(tmp_path):
    qdir, fdir, _ = _write(tmp_path, "awq")
    with pytest.raises(ConfigError, match="gptq loads gptq checkpoints.*quantized as awq"):
        LLM(str(qdir), quantization="gptq", show_progress=False, kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match="awq loads awq checkpoints.*not quantized"):
        LLM(str(fdir), quantization="awq", show_progress=False, kv_cache_memory="16MiB")
    with pytest.raises(ConfigError, match="none: .*awq checkpoint"):
        LLM(str(qdir), quantization="none", show_progress=False, kv_cache_memory="16MiB")
    llm = LLM(str(qdir), quantization="awq", show_progress=False, kv_cache_memory="16MiB")
    assert isinstance(llm.engine.runner.model.layers[1].mlp.gate_up_proj, QuantLinear)


def _corrupt(qdir, name: str, change) -> None:
    from safetensors.torch import load_file, save_file
    path = str(qdir / "model.safetensors")
    t = load_file(path)
    t[name] = change(t[name])
    save_file(t, path)


def _nan_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize("fmt,tensor,change,match", [
    ("awq", "scales", _nan_first, r"scales holds 1 NaN or infinite"),
    ("gptq", "scales", lambda t: t.clone().fill_(float("inf")), r"scales holds \d+ NaN or infinite"),
    ("awq", "qweight", lambda t: t.float(), "qweight is torch.float32; packed codes are int32 words"),
    ("gptq", "qzeros", lambda t: t.to(torch.int16), "qzeros is torch.int16; packed codes are int32"),
    ("gptq", "g_idx", lambda t: t.float(), "g_idx is torch.float32; group indices are integers"),
])
def test_corrupt_packed_tensors_are_load_errors(tmp_path, fmt, tensor, change, match):
    """A non-finite scale would load and turn the outputs it touches into NaN; packed words or
    group indices of another dtype would load as other weights. Each is refused naming the
    projection and the tensor."""
    qdir, _, _ = _write(tmp_path, fmt)
    _corrupt(qdir, f"model.layers.1.self_attn.k_proj.{tensor}", change)
    with pytest.raises(ModelLoadError, match=rf"layers\.1\.self_attn\.k_proj is not in {fmt}'s layout.*{match}"):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


def test_bits_as_a_float_are_refused(tmp_path):
    qdir, _, _ = _write(tmp_path, "awq", quant_cfg={"quant_method": "awq", "bits": 4.0, "group_size": G})
    with pytest.raises(ConfigError, match="bits 4.0"):
        LLM(str(qdir), device="cpu", show_progress=False, kv_cache_memory="16MiB")


def test_a_packed_checkpoint_across_ranks_is_refused_before_they_start(tmp_path, monkeypatch):
    """Packed weights load on one rank: tensor parallelism over a checkpoint is refused naming
    the option, before any rank's process is started."""
    from kvserve.engine import tp_workers
    started = []

    def workers(*args, **kwargs):
        started.append(args)
        raise RuntimeError("a rank was started")
    monkeypatch.setattr(tp_workers, "Workers", workers)
    qdir, _, _ = _write(tmp_path, "gptq")
    with pytest.raises(ConfigError, match="tensor_parallel_size: .* is a gptq checkpoint.*use tensor_parallel_size 1"):
        LLM(str(qdir), tensor_parallel_size=2, device="cpu", show_progress=False, kv_cache_memory="16MiB")
    assert not started
