"""AutoAWQ, GPTQ and compressed-tensors 4-bit checkpoints, and compressed-tensors 8-bit ones
(Hugging Face directories), repacked at load into the int4 and int8 layouts of
``layers/quant_linear.py`` (int4: codes [N, K/2], scale and min per group of input columns;
int8: codes [N, K], a scale per group, with a min where the zero points are not all the middle,
or one scale per output channel).

Both store, per projection ``P`` (``P.qweight``, ``P.qzeros``, ``P.scales``, GPTQ also ``P.g_idx``),
eight 4-bit codes per int32, nibble i at bits 4i..4i+3, and define

    w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]   ->   q * s + min with min = -z * s

    AutoAWQ (GEMM)  qweight [K, N/8], qzeros [G, N/8]: nibble i holds output column 8c + ORDER[i],
                    ORDER = 0 2 4 6 1 3 5 7; scales [G, N]; g(k) = k // group_size
    GPTQ            qweight [K/8, N]: nibble i of row r holds input row 8r + i; qzeros [G, N/8]:
                    nibble i holds column 8c + i, and the stored zero is z - 1 (symmetric: 7);
                    scales [G, N]; g(k) = g_idx[k] (act-order, desc_act, permutes it)

    compressed-tensors (``format`` pack-quantized, ``strategy`` group; the layout vLLM and
                    llm-compressor use, and ``kvserve quantize`` writes): weight_packed [N, K/8]:
                    nibble i of word c holds column 8c + i as q + 8 (q in [-8, 7]);
                    weight_scale [N, G]; asymmetric: weight_zero_point [N/8, G] packed the same
                    way down the rows; weight_shape [N, K]; act-order: weight_g_idx [K].
                    8 bits: four codes a word, byte i holding column 4c + i as q + 128
                    (q in [-128, 127]); ``strategy`` channel: weight_scale [N, 1]

With act-order the input columns of a group are scattered: the layer keeps them sorted by group
(a permutation of K it applies to x first), so its groups are contiguous again. q/k/v (and
gate/up) share their input, hence their act-order, and are stacked by rows as one matrix.
"""
from __future__ import annotations

import json
import os

import torch

from kvserve.errors import ConfigError, ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSORS = (".qweight", ".qzeros", ".scales", ".g_idx",  # a packed projection's tensors
           ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")
CT = "compressed-tensors"
# our merged projection -> its checkpoint parts, in row order (also what `kvserve quantize` writes)
PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


def read_config(directory: str, cfg: dict) -> dict | None:
    """The checkpoint's quantization config: config.json's ``quantization_config``, else AutoGPTQ's
    quantize_config.json (None: an unquantized checkpoint). Either must be a JSON object."""
    q = cfg.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise ModelLoadError(f"{directory}/config.json: quantization_config must be an object with a "
                             f"quant_method; got {q!r}"[:300])
    path = os.path.join(directory, "quantize_config.json")
    if q is None and os.path.exists(path):
        try:
            with open(path) as f:
                got = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(got, dict):
            raise ModelLoadError(f"{path}: must be a JSON object (GPTQ's bits, group_size, desc_act); got "
                                 f"{type(got).__name__}")
        q = {"quant_method": "gptq", **got}
    return q


def check_config(q: dict, name: str) -> tuple[str, int, bool | None, int]:
    """(method, group size (0: per output channel), symmetric, bits) of a config this reader
    loads; ConfigError naming the field otherwise. ``symmetric``: compressed-tensors' flag, whose
    checkpoints carry zero points exactly when it is false; None for AWQ and GPTQ, which always
    carry them."""
    method = str(q.get("quant_method", "")).lower()
    if method == CT:
        w = _ct_weights(q, name)
        return CT, w["group_size"] or 0, w.get("symmetric", True), w["num_bits"]
    if method not in ("awq", "gptq"):
        raise ConfigError("quantization", f"{name}'s quant_method {q.get('quant_method')!r} is not loaded; "
                          f"supported: awq, gptq, {CT}")
    if not _int_in(q.get("bits", q.get("w_bit")), (4,)):
        raise ConfigError("quantization", f"{name}: bits {q.get('bits', q.get('w_bit'))!r}; the int4 kernels take 4")
    g = q.get("group_size", q.get("q_group_size"))
    if not _int_in(g, (32, 64, 128)):
        raise ConfigError("quantization", f"{name}: group_size {g!r}; the int4 kernels take 32, 64 or 128")
    if method == "awq" and (str(q.get("version", "gemm")).lower() != "gemm" or not q.get("zero_point", True)):
        raise ConfigError("quantization", f"{name}: AWQ version {q.get('version')!r} / zero_point "
                          f"{q.get('zero_point')!r}; AutoAWQ's GEMM layout with zero points is loaded")
    if method == "gptq" and str(q.get("checkpoint_format", "gptq")).lower() != "gptq":
        raise ConfigError("quantization", f"{name}: checkpoint_format {q.get('checkpoint_format')!r}; "
                          f"GPTQ's own (v1) layout is loaded")
    return method, g, None, 4


def _ct_weights(q: dict, name: str) -> dict:
    """The weights scheme of a compressed-tensors config this reader loads: one config group of
    int4 group-wise or int8 group-wise or per-channel weights on the Linear layers, packed, no
    activation quantization."""
    def bad(field: str, got, want: str) -> ConfigError:
        return ConfigError("quantization", f"{name}: compressed-tensors {field} {got!r}; {want}")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise bad("config_groups", groups, "one group of 4- or 8-bit weights is loaded")
    (group,) = groups.values()
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise bad("config group", group, "a group with a weights scheme is loaded")
    fmt = group.get("format") or q.get("format")
    if fmt != "pack-quantized":
        raise bad("format", fmt, "pack-quantized is loaded")
    targets = group.get("targets")
    if not isinstance(targets, list) or "Linear" not in targets:
        raise bad("targets", group.get("targets"), "the Linear layers must be the target")
    if group.get("input_activations") is not None:
        raise bad("input_activations", group.get("input_activations"), "weight-only schemes are loaded")
    w = group["weights"]
    if w.get("type") != "int":
        raise bad("weights.type", w.get("type"), "the int4 and int8 kernels take 'int'")
    if not _int_in(w.get("num_bits"), (4, 8)):
        raise bad("weights.num_bits", w.get("num_bits"), "the int4 and int8 kernels take 4 or 8")
    strategies = ("group",) if w["num_bits"] == 4 else ("group", "channel")
    if w.get("strategy") not in strategies:
        raise bad("weights.strategy", w.get("strategy"), f"the int{w['num_bits']} kernels take "
                  f"{' or '.join(map(repr, strategies))}")
    if w["strategy"] == "channel":
        if w.get("group_size") is not None:
            raise bad("weights.group_size", w.get("group_size"), "a channel strategy has none (null)")
    elif not _int_in(w.get("group_size"), (32, 64, 128)):
        raise bad("weights.group_size", w.get("group_size"), f"the int{w['num_bits']} kernels take 32, 64 or 128")
    if w.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
        raise bad("weights.actorder", w.get("actorder"), "null, group, weight, static or dynamic")
    if not isinstance(w.get("symmetric", True), bool):
        raise bad("weights.symmetric", w.get("symmetric"), "true or false")
    return w


def _int_in(v, allowed: tuple[int, ...]) -> bool:
    """v is one of ``allowed`` as an integer (not 64.0, not True)."""
    return isinstance(v, int) and not isinstance(v, bool) and v in allowed


def unpack_ct(packed, scale, zero_point, shape, g_idx, bits: int = 4):
    """-> (codes [N, K] uint8 (q + 2^(b-1)), scales [N, G], zeros [N, G] float32 in the codes'
    unit (2^(b-1) when symmetric), g_idx). ``shape``: the weight_shape tensor."""
    if shape.is_floating_point() or shape.dtype == torch.bool or shape.shape != (2,):
        raise RuntimeError(f"weight_shape is {shape.dtype} {tuple(shape.shape)}; it is [N, K] as integers")
    N, K = shape.tolist()
    per = 32 // bits
    _check_scales(scale, "weight_scale")
    if g_idx is not None and (g_idx.is_floating_point() or g_idx.dtype == torch.bool):
        raise RuntimeError(f"weight_g_idx is {g_idx.dtype}; group indices are integers")
    if packed.dtype != torch.int32 or packed.shape != (N, -(-K // per)) or scale.dim() != 2 or scale.shape[0] != N:
        raise RuntimeError(f"weight_packed {tuple(packed.shape)} {packed.dtype} / weight_scale "
                           f"{tuple(scale.shape)} for weight_shape [{N}, {K}] at {bits} bits")
    q = _fields(packed, bits).reshape(N, -1)[:, :K]
    if zero_point is None:
        z = torch.full(scale.shape, float(1 << (bits - 1)))
    else:
        if zero_point.dtype != torch.int32 or zero_point.shape != (-(-N // per), scale.shape[1]):
            raise RuntimeError(f"weight_zero_point {tuple(zero_point.shape)} {zero_point.dtype}")
        z = _fields(zero_point.t().contiguous(), bits).reshape(scale.shape[1], -1)[:, :N].t().float()
    return q.to(torch.uint8), scale.float(), z, None if g_idx is None else g_idx.long()


def _fields(p: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] -> [R, C, 32 / bits]: field i (bits b i up) of each word, unsigned."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.device)
    return (p.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _check_scales(scales: torch.Tensor, name: str) -> None:
    """Scales are floating point and finite: a NaN or infinite one would load and turn every
    output it touches into NaN."""
    if not scales.is_floating_point():
        raise RuntimeError(f"{name} is {scales.dtype}; scales are floating point")
    if not bool(torch.isfinite(scales).all()):
        raise RuntimeError(f"{name} holds {int((~torch.isfinite(scales)).sum())} NaN or infinite values")


def _check_words(**tensors: torch.Tensor) -> None:
    """AutoAWQ's and GPTQ's packed codes and zeros are int32 words."""
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} is {t.dtype}; packed codes are int32 words")


def unpack_awq(qweight, qzeros, scales, g: int):
    """-> (codes [N, K] uint8, scales [N, G], zeros [N, G] float32, g_idx None)."""
    _check_scales(scales, "scales")
    _check_words(qweight=qweight, qzeros=qzeros)
    order = torch.tensor(AWQ_ORDER)
    q = torch.empty_like(_fields(qweight))
    q[..., order] = _fields(qweight)
    z = torch.empty_like(_fields(qzeros))
    z[..., order] = _fields(qzeros)
    K = qweight.shape[0]
    return (q.reshape(K, -1).t().to(torch.uint8), scales.float().t(),
            z.reshape(z.shape[0], -1).t().float(), None)


def unpack_gptq(qweight, qzeros, scales, g_idx):
    """-> (codes [N, K] uint8, scales [N, G], zeros [N, G] float32, g_idx [K])."""
    _check_scales(scales, "scales")
    _check_words(qweight=qweight, qzeros=qzeros)
    if qweight.dim() != 2:
        raise RuntimeError(f"qweight has {qweight.dim()} dimensions; GPTQ's is [K/8, N]")
    if g_idx.is_floating_point() or g_idx.dtype == torch.bool:
        raise RuntimeError(f"g_idx is {g_idx.dtype}; group indices are integers")
    q = _fields(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
    z = _fields(qzeros).reshape(qzeros.shape[0], -1) + 1
    return q.t().to(torch.uint8), scales.float().t(), z.t().float(), g_idx.long()


def repack(codes, scales, zeros, g_idx, g: int, name: str):
    """-> (codes [N, K] with the columns sorted by group, scales and mins [N, G], the column order
    or None where it is the identity)."""
    N, K = codes.shape
    if K % g or scales.shape != (N, K // g) or zeros.shape != scales.shape:
        raise ModelLoadError(f"{name}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit "
                             f"{K} input columns in groups of {g}")
    perm = None
    if g_idx is not None:
        if g_idx.shape != (K,) or g_idx.min() < 0 or g_idx.max() >= K // g:
            raise ModelLoadError(f"{name}: g_idx does not map {K} columns to {K // g} groups")
        if not torch.equal(g_idx, torch.arange(K) // g):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(torch.bincount(g_idx, minlength=K // g), torch.full((K // g,), g)):
                raise ModelLoadError(f"{name}: g_idx puts other than {g} columns in a group")
            codes = codes[:, perm]
    return codes, scales, -zeros * scales, perm


def pack_projections(model: torch.nn.Module, tensors: dict[str, torch.Tensor], q: dict, name: str
                     ) -> frozenset[str]:
    """Replace each decoder projection by a ``QuantLinear`` of the checkpoint's packed tensors
    (``tensors``: every tensor by name, loaded lazily is fine); returns the names taken."""
    from kvserve.layers.gguf_blocks import compact
    from kvserve.layers.quant_linear import QuantLinear
    from kvserve.layers.rtn import pack_int4
    method, g, symmetric, bits = check_config(q, name)
    taken: set[str] = set()
    for i, _ in enumerate(model.layers):
        for ours, parts in PARTS.items():
            old = model.get_submodule(f"layers.{i}.{ours}")
            rows, perms = [], []
            for part in parts:
                p = f"model.layers.{i}.{part}"
                need, extra = _NEED[method]
                missing = [f"{p}.{t}" for t in need if f"{p}.{t}" not in tensors]
                if missing:
                    raise ModelLoadError(f"{name}: quantization_config says {method}, but {missing[0]} is missing")
                _check_layout(method, p, tensors, old.in_features, name)
                if method == CT and symmetric == (f"{p}.weight_zero_point" in tensors):
                    raise ModelLoadError(f"{name}: quantization_config says symmetric={str(symmetric).lower()}, but "
                                         f"{p}.weight_zero_point is {'present' if symmetric else 'missing'}")
                t = [tensors[f"{p}.{x}"] for x in need] + [tensors.get(f"{p}.{x}") for x in extra]
                need += tuple(x for x in extra if f"{p}.{x}" in tensors)
                try:
                    u = (unpack_awq(*t, g) if method == "awq" else unpack_gptq(*t) if method == "gptq"
                         else unpack_ct(t[0], t[1], t[3], t[2], t[4], bits))
                except (RuntimeError, ValueError, TypeError) as e:
                    raise ModelLoadError(f"{name}: {p} is not in {method}'s layout ({e})") from None
                codes, s, m, perm = repack(*u, g or u[0].shape[1], p)
                rows.append((codes, s, m))
                perms.append(perm)
                taken |= {f"{p}.{x}" for x in need}
            if any(not _same(perms[0], x) for x in perms[1:]):
                raise ModelLoadError(f"{name}: layer {i}'s {', '.join(parts)} order their input columns "
                                     f"differently (act-order); they share one input and must agree")
            codes, s, m = (torch.cat(x) for x in zip(*rows))
            if codes.shape != (old.out_features, old.in_features):
                raise ModelLoadError(f"{name}: layer {i}'s {ours} unpacks to {tuple(codes.shape)}, expected "
                                     f"[{old.out_features}, {old.in_features}]")
            dev = old.weight.device
            group = g
            if bits == 8:
                codes, group, s, m = _as_int8(codes, g, s, m)
            if dev.type != "cpu":  # the CPU kernel takes float32; CUDA ones the narrowest exact dtype
                s, m = compact(s, m)
            new = QuantLinear(f"int{bits}", old.in_features, old.out_features, group,
                              (pack_int4(codes) if bits == 4 else codes).to(dev), s.to(dev),
                              None if m is None else m.to(dev), old.bias, fmt=method,
                              perm=None if perms[0] is None else perms[0].to(dev))
            parent, _, attr = f"layers.{i}.{ours}".rpartition(".")
            setattr(model.get_submodule(parent), attr, new)
    return frozenset(taken)


def _as_int8(codes: torch.Tensor, g: int, s: torch.Tensor, m: torch.Tensor):
    """8-bit codes (q + 128, uint8) with ``repack``'s scales and mins -> the int8 layer's: signed
    codes, the min moved by the 128 taken off (None where every min is then 0: symmetric), and
    per output channel (g 0, scales [N]) where the checkpoint's channel strategy allows it. An
    asymmetric channel's one scale and min repeat over groups of the kernels' largest size that
    divides K (the int8 kernels take a min per group only)."""
    N, K = codes.shape
    q = (codes.to(torch.int16) - 128).to(torch.int8)
    m = m + 128 * s
    if not m.any():
        m = None
    if g and g != K:
        return q, g, s, m
    if m is None:  # one symmetric scale a channel
        return q, 0, s[:, 0].contiguous(), None
    g = next((x for x in (128, 64, 32, 16) if K % x == 0), None)
    if g is None:
        raise ModelLoadError(f"an asymmetric 8-bit channel needs K ({K}) divisible by 16")
    return q, g, s.expand(N, K // g).contiguous(), m.expand(N, K // g).contiguous()


# a projection's tensors by method: (required, optional)
_NEED = {"awq": (("qweight", "qzeros", "scales"), ()), "gptq": (("qweight", "qzeros", "scales", "g_idx"), ()),
         CT: (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx"))}


def _check_layout(method: str, p: str, tensors: dict[str, torch.Tensor], K: int, name: str) -> None:
    """AutoAWQ's qweight is [K, N/8], GPTQ's [K/8, N] (K the projection's input width): one that is
    not is a checkpoint whose tensors another layout wrote than its config names (GPTQ's tensors
    carry a g_idx, AWQ's none), refused as such rather than by the shapes it unpacks to."""
    if method not in ("awq", "gptq"):
        return
    q = tensors[f"{p}.qweight"]
    rows = K if method == "awq" else K // 8
    if q.dim() == 2 and q.shape[0] == rows:
        return
    want = "[in_features, out_features / 8]" if method == "awq" else "[in_features / 8, out_features]"
    hint = ""
    if method == "awq" and f"{p}.g_idx" in tensors:
        hint = f"; {p}.g_idx is present, as in GPTQ's tensors"
    elif method == "gptq" and q.dim() == 2 and q.shape[0] == K:
        hint = "; its rows are the input width, as in AutoAWQ's tensors"
    raise ModelLoadError(f"{name}: quantization_config says {method}, whose qweight is {want} ({rows} rows here), "
                         f"but {p}.qweight is {tuple(q.shape)}{hint}")


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
