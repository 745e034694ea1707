"""``kvserve quantize`` (RTN, AWQ, GPTQ) and the compressed-tensors checkpoints it writes.

References we did not write: the ``compressed-tensors`` library's own packing and, through
transformers' loader for that format, its decompression and transformers' forward on the same
checkpoint; plain float math for the quantizers' objectives. The models are small random Llamas
(grouped-query and multi-head attention) with a byte-level tokenizer trained on the spot.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from byte_tokenizer import build

from kvserve import LLM
from kvserve.errors import ConfigError, ModelLoadError
from kvserve.layers.linear import dense_parameters, unpack_cpu_weights
from kvserve.layers.quant_linear import QuantLinear
from kvserve.quantize import _awq_layer, calibrate, pack_int32, quantize
from kvserve.quantize import algorithms as A

pytestmark = pytest.mark.unit
TEXT = ("The quick brown fox jumps over the lazy dog. " * 8 + '{"name": "Ada", "age": 36, "tags": ["math"]} ' * 8
        + "0123456789 red green blue yes no maybe " * 8)


def _model_dir(path, heads: int, kv_heads: int, seed: int = 0, h: int = 128) -> str:
    """A random Llama (hidden size ``h``) in float32, with outlier channels in its norms (the
    activations AWQ and GPTQ are built for), and the byte-level tokenizer."""
    from safetensors.torch import save_file
    inter, vocab, layers = 2 * h, 512, 2
    d = h // heads
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.5,
         "model.norm.weight": torch.rand(h, generator=g) + 0.5}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            w = torch.rand(h, generator=g) + 0.5
            w[torch.randperm(h, generator=g)[:4]] *= 12  # a few loud channels
            t[p + n + ".weight"] = w
        for name, shape in (("self_attn.q_proj", (heads * d, h)), ("self_attn.k_proj", (kv_heads * d, h)),
                            ("self_attn.v_proj", (kv_heads * d, h)), ("self_attn.o_proj", (h, heads * d)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter))):
            t[p + name + ".weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
           "vocab_size": vocab, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 0,
           "bos_token_id": 0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [0, 3]}, f)
    build(path)
    return str(path)


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.engine.runner
    with torch.inference_mode():
        return runner.model.compute_logits(runner.hidden_states(ids))


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("gqa") / "m", heads=4, kv_heads=2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("codes_shape,dim", [((6, 40), 1), ((13, 24), 0), ((16, 64), 1), ((9, 3), 0)])
def test_packing_is_the_libraries_own(codes_shape, dim, bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    g = torch.Generator().manual_seed(sum(codes_shape) + bits)
    half = 1 << (bits - 1)
    codes = torch.randint(-half, half, codes_shape, generator=g, dtype=torch.int8)
    assert torch.equal(pack_int32(codes, dim, bits), pack_to_int32(codes, bits, packed_dim=dim))


def _layer(seed: int, n: int = 96, k: int = 256, t: int = 1024):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.2 + torch.eye(k)
    x = torch.randn(t, k, generator=g) @ mix
    x[:, torch.randperm(k, generator=g)[:6]] *= 15  # outlier input channels
    return torch.randn(n, k, generator=g) / k ** 0.5, x


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_and_awq_beat_round_to_nearest_on_their_inputs(symmetric):
    w, x = _layer(1)
    grid = A.Grid(32, symmetric, torch.float32)
    ref = x @ w.t()

    def err(wq):
        return ((x @ wq.t() - ref).pow(2).sum() / ref.pow(2).sum()).item()
    rtn = A.rtn(w, grid)
    assert rtn.codes.min() >= -8 and rtn.codes.max() <= 7
    s = A.awq_scales(w, x, grid)
    awq = A.fake_quant(w * s, grid) / s
    gptq = A.gptq(w, x.t() @ x, grid)
    ordered = A.gptq(w, x.t() @ x, grid, act_order=True)
    assert err(gptq.dequantize()) < 0.7 * err(rtn.dequantize())
    assert err(ordered.dequantize()) < 0.7 * err(rtn.dequantize())
    assert err(awq) < err(rtn.dequantize())
    # act-order keeps the groups as runs of columns, each with the grid of its original weights
    assert ordered.g_idx is None
    assert torch.equal(ordered.scales, rtn.scales) and torch.equal(ordered.zeros, rtn.zeros)
    assert torch.equal(ordered.dequantize(), (ordered.codes.float() - ordered.zeros.float().repeat_interleave(32, 1))
                       * ordered.scales.float().repeat_interleave(32, 1))


def test_weighted_ranges_round_no_worse_on_the_layers_output():
    """AWQ's rounding: with each column's importance (its scaled inputs' mean squares) each group's range
    is chosen on the weighted error, which is then never above the unweighted choice's, and the
    layer's output on its inputs is rounded closer."""
    w, x = _layer(4)
    grid = A.Grid(32, False, torch.float32)
    imp = x.pow(2).mean(dim=0)
    wg = w.view(w.shape[0], -1, 32)

    def weighted(s, z):
        q = torch.round(wg / s[..., None] + z[..., None]).clamp(grid.qmin, grid.qmax)
        return (((q - z[..., None]) * s[..., None] - wg).pow(2) * imp.view(-1, 32)).sum(dim=-1)
    plain = weighted(*A.group_params(wg, grid))
    chosen = weighted(*A.group_params(wg, grid, importance=imp.view(-1, 32)))
    assert (chosen <= plain * (1 + 1e-6)).all() and chosen.sum() < plain.sum()
    ref = x @ w.t()
    out = {k: (x @ A.rtn(w, grid, importance=v).dequantize().t() - ref).pow(2).sum().item() for k, v in
           (("plain", None), ("weighted", imp))}
    assert out["weighted"] < out["plain"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_mse_observer_never_rounds_a_group_worse_than_its_extremes(symmetric):
    """Heavy-tailed rows (as trained weights are): a group's range shrunk to clip its extremes
    rounds the group closer, and the unshrunk range is among those tried."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 256, generator=g).pow(4) * 3  # heavy tails
    wg = w.view(64, -1, 32)

    def err(grid, widen=True):
        s, z = A.group_params(wg, grid, widen)
        q = torch.round(wg / s[..., None] + z[..., None]).clamp(grid.qmin, grid.qmax)
        assert q.min() >= grid.qmin and q.max() <= grid.qmax
        return ((q - z[..., None]) * s[..., None] - wg).pow(2).sum(dim=-1)
    minmax = err(A.Grid(32, symmetric, torch.float32), widen=False)  # the extremes' grid
    mse = err(A.Grid(32, symmetric, torch.float32, "mse"))
    assert (mse <= minmax * (1 + 1e-6)).all()
    assert mse.sum() < 0.97 * minmax.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_asymmetric_minmax_steps_align_the_grid_and_clip_nothing(dtype):
    """Asymmetric groups store an integer zero point, so their levels are multiples of the step
    and the minimum lies up to half a step off one. The minmax observer's step, chosen among the
    extremes' (max - min) / 15 and up to 10% wider, rounds every group at least as close as the
    extremes' step alone (computed here from its definition), many of them closer, and leaves
    every weight within half a step of a level: nothing clipped."""
    g = torch.Generator().manual_seed(5)
    # groups of different spreads and off-centre means (as trained weights' groups are)
    spread, mean = torch.rand(48, 8, 1, generator=g), 0.3 * torch.randn(48, 8, 1, generator=g)
    wg = torch.randn(48, 8, 64, generator=g) * spread + mean
    grid = A.Grid(64, False, dtype)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s0 = ((hi - lo) / 15).to(dtype).float()
    z0 = torch.round(-8 - lo / s0).clamp(-8, 7)

    def rounded(s, z):
        q = torch.round(wg / s[..., None] + z[..., None]).clamp(-8, 7)
        return (q - z[..., None]) * s[..., None]
    plain = (rounded(s0, z0) - wg).pow(2).sum(-1)
    s, z = A.group_params(wg, grid)
    assert s.dtype == torch.float32 and torch.equal(s, s.to(dtype).float())  # steps the checkpoint stores exactly
    assert (z == z.round()).all() and z.min() >= -8 and z.max() <= 7
    assert (s >= s0).all() and (s <= 1.1 * s0 * (1 + 2 ** -7)).all()
    got = (rounded(s, z) - wg).pow(2).sum(-1)
    assert (got <= plain * (1 + 1e-6)).all()
    assert (got < plain).float().mean() > 0.3 and got.sum() < 0.99 * plain.sum()
    # (a step stored in bfloat16 may round down: 15 steps then fall short of the range by up to
    # 15 of its relative precision, 2^-8, of a step)
    slack = 15 * 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert ((rounded(s, z) - wg).abs() <= s[..., None] * (0.5 + slack)).all()
    # the symmetric grid and the mse observer are as before: the extremes' step, then shrunk
    sym = A.Grid(64, True, dtype)
    assert torch.equal(A.group_params(wg, sym)[0], A.group_params(wg, sym, widen=False)[0])


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["multi-head", "grouped-query"])
def test_awq_folding_keeps_the_model_equivalent(tmp_path, kv_heads):
    """Scales folded into the norms, up_proj and v_proj (under grouped-query attention one scale
    for the query heads that share a KV head): without rounding, the model computes the same
    logits."""
    path = _model_dir(tmp_path / "m", heads=4, kv_heads=kv_heads, seed=2)
    llm = LLM(path, quantization="none", enable_prefix_caching=False, show_progress=False, kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    unpack_cpu_weights(model)
    ids = llm.engine.tokenizer.encode(TEXT)
    before = _logits(llm, ids[:60])
    inputs = calibrate(llm, ids, 64, keep=128)
    params = {k: v.detach().clone() for k, v in dense_parameters(model)}
    grid = A.Grid(32, True, torch.float32)
    for i in range(2):
        _awq_layer(params, inputs, f"layers.{i}.", llm.engine.arch, grid)
    assert not torch.equal(params["layers.0.input_layernorm.weight"], model.layers[0].input_layernorm.weight)
    assert not torch.equal(params["layers.0.self_attn.o_proj.weight"], model.layers[0].self_attn.o_proj.weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    after = _logits(llm, ids[:60])
    assert ((after - before).norm() / before.norm()).item() < 1e-4


@pytest.mark.parametrize("method,symmetric,act_order,bits,group", [
    ("rtn", True, False, 4, 32), ("awq", True, False, 4, 32), ("gptq", True, False, 4, 32),
    ("gptq", False, True, 4, 32), ("rtn", True, False, 8, 0), ("awq", False, False, 8, 32), ("gptq", True, True, 8, 0),
    ("rtn", False, False, 8, 0)])
def test_checkpoint_loads_in_kvserve_and_transformers_alike(gqa_model, tmp_path, method, symmetric, act_order, bits,
                                                           group):
    """8 bits: groups, or one scale per output channel (group 0; an asymmetric channel loads as
    the int8 kernels' groups, each repeating the channel's scale and min)."""
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "q")
    quantize(gqa_model, out, method, bits=bits, group_size=group, symmetric=symmetric, act_order=act_order,
             text=TEXT, num_tokens=256, chunk=64)
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == [0, 3]
    cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    weights = cfg["config_groups"]["group_0"]["weights"]
    assert weights["symmetric"] is symmetric and weights["num_bits"] == bits
    assert (weights["strategy"], weights["group_size"]) == (("group", group) if group else ("channel", None))
    llm = LLM(out, show_progress=False, kv_cache_memory="16MiB")
    layer = llm.engine.runner.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    assert layer.self_attn.qkv_proj.method == f"int{bits}"
    assert layer.mlp.down_proj.group_size == (group or (0 if symmetric else 128))  # (its K is 256)
    # every projection as the format's library decompresses it, read back through kvserve's layer
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file
    weights = QuantizationArgs(**cfg["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for ours_name, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
        rows = []
        for part in parts:
            pre = f"model.layers.1.{'self_attn' if len(part) == 1 else 'mlp'}.{part}_proj."
            sd = {k.removeprefix(pre): v for k, v in tensors.items() if k.startswith(pre)}
            rows.append(PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float())
        mod = llm.engine.runner.model.get_submodule(f"layers.1.{ours_name}")
        with torch.inference_mode():
            assert torch.allclose(mod(torch.eye(mod.in_features)).t(), torch.cat(rows), rtol=1e-6, atol=1e-7)
    ids = llm.engine.tokenizer.encode("The lazy dog jumps over the quick brown fox. [1, 2, 3]")
    ours = _logits(llm, ids)
    if symmetric:  # transformers' loader (compressed-tensors 0.20) sizes asymmetric zero points unpacked
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    fp = LLM(gqa_model, show_progress=False, kv_cache_memory="16MiB")
    base = _logits(fp, ids)
    assert 0 < ((ours - base).norm() / base.norm()).item() < 1  # quantized, and the same model still


@pytest.mark.parametrize("kwargs,field", [
    ({"method": "hqq"}, "method"), ({"bits": 3}, "bits"), ({"bits": 2**63}, "bits"),
    ({"group_size": 48}, "group_size"), ({"group_size": True}, "group_size"), ({"num_tokens": 8}, "num_tokens"),
    ({"num_tokens": float("nan")}, "num_tokens"), ({"group_size": 32.0}, "group_size"), ({"bits": 4.0}, "bits"),
    ({"chunk": 0}, "chunk"), ({"text": ""}, "text"), ({"calibration_memory": 0}, "calibration_memory"),
    ({"calibration_memory": float("nan")}, "calibration_memory"), ({"calibration_memory": 2**63}, "calibration_memory"),
    ({"calibration_memory": "8GiB"}, "calibration_memory"), ({"calibration_memory": None}, "calibration_memory"),
    ({"method": "awq", "act_order": True}, "act_order"), ({"text": "a b"}, "text"),
    ({"observer": "max"}, "observer"), ({"observer": ""}, "observer"), ({"observer": 3}, "observer"),
    ({"group_size": 0}, "group_size: must be one of 32, 64, 128 at 4 bits"),
    ({"bits": 8, "group_size": 16}, "group_size: must be one of 0, 32, 64, 128 at 8 bits"), ({"bits": 16}, "bits"),
    ({"bits": 8.0}, "bits"), ({"bits": None}, "bits"),
])
def test_bad_arguments_name_the_field(gqa_model, tmp_path, kwargs, field):
    args = {"method": "rtn", "group_size": 32, "text": TEXT, "num_tokens": 64} | kwargs
    with pytest.raises(ConfigError, match=field):
        quantize(gqa_model, str(tmp_path / "q"), **args)
    assert not os.path.exists(tmp_path / "q")


@pytest.mark.parametrize("method, observer, want", [("gptq", None, "mse"), ("rtn", None, "minmax"),
                                                     ("awq", None, "minmax"), ("gptq", "minmax", "minmax")])
def test_the_checkpoint_names_the_observer_its_groups_came_from(gqa_model, tmp_path, method, observer, want):
    out = str(tmp_path / "q")
    config = quantize(gqa_model, out, method, group_size=32, text=TEXT, num_tokens=64, chunk=64, observer=observer)
    written = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert written == config and config["config_groups"]["group_0"]["weights"]["observer"] == want


def test_refused_sources_and_destinations(gqa_model, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        quantize(gqa_model, str(tmp_path / "full"), "rtn", group_size=32, text=TEXT, num_tokens=64)
    for out in ("", "  "):
        with pytest.raises(ConfigError, match="out: must be the path of a new or empty directory"):
            quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64)
    with pytest.raises(ModelLoadError, match="a dummy source"):
        quantize("dummy:tiny", str(tmp_path / "q"), "rtn", group_size=32, text=TEXT, num_tokens=64)
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    with pytest.raises(ModelLoadError, match="already quantized"):
        quantize(out, str(tmp_path / "q2"), "rtn", group_size=32, text=TEXT, num_tokens=64)
    narrow = _model_dir(tmp_path / "narrow", heads=4, kv_heads=2, h=96)
    with pytest.raises(ConfigError, match=r"group_size: must divide every projection's input width \(96, 192"):
        quantize(narrow, str(tmp_path / "q3"), "rtn", group_size=64, text=TEXT, num_tokens=64)


@pytest.mark.parametrize("change,match", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "num_bits 3"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8.0), "num_bits 8.0"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=True), "num_bits True"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None),
     "strategy 'channel'; the int4 kernels take 'group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel"), "group_size 32"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="tensor"), "strategy 'tensor'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16), "group_size 16"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32.0), "group_size 32.0"),
    (lambda q: q["config_groups"]["group_0"].update(targets="NotLinear"), "targets 'NotLinear'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric="yes"), "symmetric 'yes'"),
    (lambda q: q.update(format="naive-quantized") or q["config_groups"]["group_0"].pop("format"), "format"),
    (lambda q: q["config_groups"].update(group_1=q["config_groups"]["group_0"]), "config_groups"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
])
def test_unsupported_compressed_tensors_configs_are_refused(gqa_model, tmp_path, change, match):
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    change(cfg["quantization_config"])
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ConfigError, match=match):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


def test_a_config_whose_bits_its_tensors_do_not_have_is_refused(gqa_model, tmp_path):
    """A 4-bit checkpoint whose config says 8 bits: its packed words hold eight codes, not four,
    and the load names the tensor and the width."""
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ModelLoadError, match=r"is not in compressed-tensors's layout \(weight_packed .* at 8 bits"):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 0)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_a_checkpoint_the_format_library_wrote_loads(gqa_model, tmp_path, symmetric, bits, group):
    """Scales and zero points from compressed-tensors' own ``calculate_qparams``, packed by its
    own compressor, config from its own ``QuantizationConfig``: kvserve loads every projection
    as the library decompresses it. 8 bits in groups of 32 and per output channel (group 0)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group or None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = tmp_path / "ct"
    out.mkdir()
    for f in os.listdir(gqa_model):
        if f != "model.safetensors":
            (out / f).write_bytes(open(os.path.join(gqa_model, f), "rb").read())
    tensors, expected = {}, {}
    for name, w in load_file(os.path.join(gqa_model, "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w
            continue
        groups = w.view(w.shape[0], -1, group or w.shape[1])
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale,
                                                        "weight_zero_point": zero}, scheme)
        prefix = name.removesuffix("weight")
        tensors.update({prefix + k: v for k, v in packed.items()})
        expected[prefix.rstrip(".")] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"].float()
    save_file(tensors, str(out / "model.safetensors"))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=["lm_head"]).model_dump()
    cfg = json.load(open(out / "config.json"))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", **qc}
    json.dump(cfg, open(out / "config.json", "w"))
    llm = LLM(str(out), show_progress=False, kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    for i in range(2):
        for ours, parts in (("self_attn.qkv_proj", ("q", "k", "v")), ("self_attn.o_proj", ("o",)),
                            ("mlp.gate_up_proj", ("gate", "up")), ("mlp.down_proj", ("down",))):
            mod = model.get_submodule(f"layers.{i}.{ours}")
            assert isinstance(mod, QuantLinear)
            want = torch.cat([expected[f"model.layers.{i}.{ours.split('.')[0]}.{p}_proj"] for p in parts])
            with torch.inference_mode():
                assert torch.allclose(mod(torch.eye(mod.in_features)).t(), want, rtol=1e-6, atol=1e-7), (i, ours)


def test_a_failed_write_leaves_nothing_and_touches_no_neighbour(gqa_model, tmp_path, monkeypatch):
    import safetensors.torch
    (tmp_path / "q.partial").mkdir()
    (tmp_path / "q.partial" / "notes.txt").write_text("mine")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        quantize(gqa_model, str(tmp_path / "q"), "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    assert sorted(os.listdir(tmp_path)) == ["q.partial"] and (tmp_path / "q.partial" / "notes.txt").exists()


def test_the_source_dtype_and_architecture_are_kept(tmp_path):
    """A config that says ``dtype`` (transformers' newer key) is written in that dtype; a
    config without ``architectures`` gets its family's, as vLLM needs one."""
    path = _model_dir(tmp_path / "f16", heads=4, kv_heads=2, seed=5)
    cfg = json.load(open(os.path.join(path, "config.json")))
    del cfg["torch_dtype"], cfg["architectures"]
    json.dump({**cfg, "dtype": "float16"}, open(os.path.join(path, "config.json"), "w"))
    out = str(tmp_path / "q")
    quantize(path, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    written = json.load(open(os.path.join(out, "config.json")))
    assert written["dtype"] == written["torch_dtype"] == "float16"
    assert written["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float16
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.float16


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_points_must_match_the_schemes_symmetry(gqa_model, tmp_path, symmetric):
    """A scheme that says symmetric over tensors with zero points, or asymmetric over tensors
    without them, is refused naming the tensor, not loaded with zero points made up or ignored."""
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, symmetric=symmetric, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = not symmetric
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ModelLoadError, match=f"symmetric={str(not symmetric).lower()}, but "
                                             f"model.layers.0.self_attn.q_proj.weight_zero_point is "
                                             f"{'present' if not symmetric else 'missing'}"):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


def test_integer_scales_are_a_load_error(gqa_model, tmp_path):
    from safetensors.torch import load_file, save_file
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    t["model.layers.1.self_attn.k_proj.weight_scale"] = t["model.layers.1.self_attn.k_proj.weight_scale"].int()
    save_file(t, path)
    with pytest.raises(ModelLoadError, match="k_proj is not in compressed-tensors's layout.*scales are floating"):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


def test_the_checkpoints_files_are_as_readable_as_the_umask_allows(gqa_model, tmp_path):
    """Every file of the checkpoint (the safetensors writer's own 0600 included) takes the mode a
    new file gets under the process's umask: other users can load it where they can read the
    directory."""
    old = os.umask(0o022)
    try:
        out = str(tmp_path / "q")
        quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    finally:
        os.umask(old)
    modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_a_snapshot_of_a_packed_checkpoint_is_refused_by_name(gqa_model, tmp_path, capsys):
    """A snapshot holds float weights: the command refuses a packed checkpoint naming the model,
    and a quantization method naming the option (not the engine's "leave quantization unset")."""
    from kvserve.cli import main
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    assert main(["snapshot", out, "--out", str(tmp_path / "s")]) == 2
    assert "compressed-tensors checkpoint, whose weights load packed; a snapshot holds float" in capsys.readouterr().err
    assert main(["snapshot", gqa_model, "--quantization", "int8", "--out", str(tmp_path / "s")]) == 2
    assert "quantization: a snapshot holds the model's float weights; got 'int8'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "s")


def test_a_malformed_weight_shape_is_a_load_error(gqa_model, tmp_path):
    from safetensors.torch import load_file, save_file
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    t["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([128, 256, 1])
    save_file(t, path)
    with pytest.raises(ModelLoadError, match="down_proj is not in compressed-tensors's layout"):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibration_in_bounded_runs_writes_the_same_checkpoint(gqa_model, tmp_path, monkeypatch, method):
    """With room for one layer's statistics at a time, the layers are calibrated one pass each
    and the checkpoint is the one a single pass writes, tensor for tensor."""
    from safetensors.torch import load_file

    import kvserve.quantize as Q
    passes = []
    real = Q.calibrate

    def counting(*args, **kwargs):
        passes.append(kwargs.get("layers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(Q, "calibrate", counting)
    outs = []
    for budget in (Q.CALIBRATION_MEMORY, 1):
        outs.append(str(tmp_path / f"q{budget}"))
        quantize(gqa_model, outs[-1], method, group_size=32, text=TEXT, num_tokens=256, chunk=64,
                 calibration_memory=budget)
    layers = LLM(gqa_model, quantization="none", show_progress=False, kv_cache_memory="16MiB").engine.arch.num_layers
    assert layers >= 2 and passes == [range(0, layers)] + [range(i, i + 1) for i in range(layers)]
    one, runs = (load_file(os.path.join(o, "model.safetensors")) for o in outs)
    assert one.keys() == runs.keys() and any(k.endswith("weight_packed") for k in one)
    for k in one:
        assert torch.equal(one[k], runs[k]), k


@pytest.mark.parametrize("tensor,change,match", [
    ("weight_scale", lambda t: t.clone().fill_(float("nan")), r"weight_scale holds \d+ NaN or infinite"),
    ("weight_shape", lambda t: t.float(), r"weight_shape is torch.float32 \(2,\); it is \[N, K\] as integers"),
])
def test_corrupt_compressed_tensors_are_load_errors(gqa_model, tmp_path, tensor, change, match):
    from safetensors.torch import load_file, save_file
    out = str(tmp_path / "q")
    quantize(gqa_model, out, "rtn", group_size=32, text=TEXT, num_tokens=64, chunk=64)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    name = f"model.layers.0.mlp.down_proj.{tensor}"
    t[name] = change(t[name])
    save_file(t, path)
    with pytest.raises(ModelLoadError, match=rf"down_proj is not in compressed-tensors's layout.*{match}"):
        LLM(out, show_progress=False, kv_cache_memory="16MiB")


def test_flags_text_and_paths_are_checked_before_any_work(gqa_model, tmp_path):
    """Wrong types name their argument, and an output path that cannot be created is refused
    before the model is loaded or quantized; pathlib paths are taken."""
    import pathlib
    args = {"method": "rtn", "group_size": 32, "text": TEXT, "num_tokens": 64}
    for kwargs, field in (({"symmetric": "no"}, "symmetric"), ({"symmetric": None}, "symmetric"),
                          ({"method": "gptq", "act_order": 1}, "act_order"), ({"text": 123}, "text")):
        with pytest.raises(ConfigError, match=f"{field}: must be"):
            quantize(gqa_model, str(tmp_path / "q"), **(args | kwargs))
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile" / "sub", tmp_path / ("n" * 250)):
        with pytest.raises(ConfigError, match="out: cannot create the checkpoint directory"):
            quantize(gqa_model, str(out), **args)
    out = tmp_path / "via-pathlib"
    quantize(pathlib.Path(gqa_model), out, chunk=64, **args)
    assert isinstance(LLM(out, show_progress=False, kv_cache_memory="16MiB").engine.runner.model.layers[0]
                      .mlp.down_proj, QuantLinear)
    assert sorted(os.listdir(tmp_path)) == ["afile", "via-pathlib"]  # no partial directory left behind


@pytest.mark.parametrize("text", ['"hello"', "[1, 2]"])
def test_config_files_that_are_not_objects_are_load_errors(gqa_model, tmp_path, text):
    """config.json and generation_config.json that parse but are not objects name the file."""
    import shutil
    for name in ("config.json", "generation_config.json"):
        d = tmp_path / name
        shutil.copytree(gqa_model, d)
        (d / name).write_text(text)
        with pytest.raises(ModelLoadError, match=f"{name}: must be a JSON object"):
            LLM(str(d), show_progress=False, kv_cache_memory="16MiB")
