"""``kvserve quantize``: a model's decoder projections quantized to 4-bit groups, or 8-bit groups
or channels, by round-to-nearest, AWQ or GPTQ (``algorithms.py``), written as a Hugging Face
directory in the compressed-tensors ``pack-quantized`` layout (the format vLLM and llm-compressor
read; kvserve loads it packed, ``models/awq_gptq.py``).

Calibration runs kvserve's own engine over the calibration text (full precision, no prefix
cache) with hooks on the projections: each keeps its inputs (AWQ's search) and their Gram
matrix X^T X (GPTQ's Hessian, float64). Every layer is calibrated on the full-precision model's
activations; GPTQ implementations that re-run each layer on the quantized layers before it see
slightly different inputs. What the hooks keep is bounded (``calibration_memory``; a hook adds
its call's temporaries, X^T X in float32 and float64, while it runs): the layers are taken in
runs that fit, one pass over the text per run, each run quantized and its statistics dropped
before the next (an 8B model's Hessians are 65.5 GB in all, 2.05 GB a layer; the default 2 GiB
takes one of its layers a pass, three of Qwen2.5-1.5B's). A pass runs only its own layers: it
starts from the hidden states the pass before ended with and stops after its last layer
(``_Carry``), so the passes cost one forward over the model together. The engine's weights are
never changed: AWQ folds its scales into copies of the layer's tensors.

AWQ's scales are folded where the model stays equivalent: the input projections' into the RMSNorm
before them, down_proj's into up_proj's rows, o_proj's into v_proj's rows. Under grouped-query
attention the query heads that share a KV head share o_proj's scales (AutoAWQ leaves o_proj
unscaled there). The scaled weights are then rounded with each asymmetric group's range chosen
on the layer's output error (its scaled inputs' mean squares per column), not the weights' own.
Only Llama-family models (a plain RMSNorm before each block) are quantized: Gemma 3's (1 + w)
norms are not handled.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from kvserve.config import INT4_GROUP_SIZES
from kvserve.errors import ConfigError, ModelLoadError
from kvserve.models.awq_gptq import PARTS
from kvserve.models.snapshot import kvserve_version
from kvserve.quantize import algorithms
from kvserve.quantize.algorithms import Grid, Quantized

METHODS = ("rtn", "awq", "gptq")
BITS = (4, 8)  # the int4 and int8 kernels' widths
_PROJ = tuple(PARTS)  # our projections, in a layer's order


def check_args(method: str, bits: int, group_size: int, num_tokens: int, chunk: int = 512,
               calibration_memory: int = 1 << 30, observer: str = "minmax") -> None:
    if method not in METHODS:
        raise ConfigError("method", f"must be one of {', '.join(METHODS)}; got {method!r}")
    if observer not in algorithms.OBSERVERS:
        raise ConfigError("observer", f"must be one of {', '.join(algorithms.OBSERVERS)}; got {observer!r}")
    if type(bits) is not int or bits not in BITS:
        raise ConfigError("bits", f"must be 4 or 8 (the int4 and int8 kernels' widths); got {bits!r}")
    sizes = INT4_GROUP_SIZES if bits == 4 else (0, *INT4_GROUP_SIZES)
    if type(group_size) is not int or group_size not in sizes:
        raise ConfigError("group_size", f"must be one of {', '.join(map(str, sizes))} at {bits} bits"
                          f"{' (0: one scale per output channel)' if bits == 8 else ''}; got {group_size!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 16 <= num_tokens <= 1 << 20:
        raise ConfigError("num_tokens", f"must be an integer in [16, 1048576]; got {num_tokens!r}")
    if type(chunk) is not int or not 16 <= chunk <= 1 << 20:
        raise ConfigError("chunk", f"must be an integer in [16, 1048576]; got {chunk!r}")
    if type(calibration_memory) is not int or not 1 <= calibration_memory < 1 << 63:
        raise ConfigError("calibration_memory", f"must be a number of bytes in [1, 2^63); got {calibration_memory!r}")


# Calibration inputs kept per projection for AWQ's search (every n-th token, over the whole
# text); GPTQ's X^T X sums every token.
AWQ_ROWS = 1024
CALIBRATION_MEMORY = 2 << 30  # bytes of calibration statistics held at once (quantize's default)


def _calibration_bytes(a, method: str) -> int:
    """What one decoder layer's hooks hold: float64 X^T X per projection (GPTQ), or AWQ_ROWS
    float32 rows of its inputs."""
    widths = a.projection_input_widths
    if method == "gptq":
        return sum(8 * k * k for k in widths)
    return sum(4 * AWQ_ROWS * k for k in widths) if method == "awq" else 0


def default_text() -> str:
    """Calibration text that ships with Python: the docstrings of standard modules and of their
    public classes and functions, about 100k tokens. ``pydoc_data`` and ``unittest`` are left
    out: kvserve's quality measurements hold them out."""
    import importlib
    import inspect
    names = ("abc argparse ast asyncio base64 bisect calendar codecs collections configparser contextlib copy "
             "csv dataclasses datetime decimal difflib dis doctest email enum fnmatch fractions functools gettext "
             "glob gzip hashlib heapq hmac html http.client inspect io ipaddress itertools json locale logging lzma "
             "mailbox math mimetypes operator optparse os pathlib pickle platform pprint queue random re sched "
             "secrets selectors shlex shutil signal smtplib socket sqlite3 ssl statistics string struct "
             "subprocess tarfile tempfile textwrap threading time timeit tokenize traceback typing urllib.parse "
             "uuid warnings weakref xml.etree.ElementTree zipfile zlib").split()
    parts = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                parts.append(f"{name}.{attr}: {inspect.getdoc(obj) or ''}")
    return "\n\n".join(p for p in parts if p.strip())


class _Inputs:
    """A projection's calibration inputs: every ``stride``-th row (AWQ's search; ``rows``) or
    X^T X (GPTQ's Hessian; ``gram``)."""

    def __init__(self, stride: int, rows: bool = True, gram: bool = True):
        self.stride, self.keep_rows, self.keep_gram = stride, rows, gram
        self.rows, self.gram, self.count = [], None, 0

    def __call__(self, module, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()
        if self.keep_gram:
            g = (x.t() @ x).double()
            if self.gram is None:
                self.gram = g
            else:
                self.gram.add_(g)
        if self.keep_rows:
            self.rows.append(x[-self.count % self.stride::self.stride].clone())
        self.count += x.shape[0]

    def x(self) -> torch.Tensor:
        return torch.cat(self.rows)


class _Carry:
    """The model's forward cut to a run of layers: a step whose tokens were seen by the run
    before starts from the hidden state that run ended with, not from the embedding, and every
    step stops after the run's last layer (calibration samples one token a prompt and drops it),
    so runs of layers cost one pass over the model in all rather than one each. A step's state is
    keyed by its tokens and positions (the same prompts are scheduled the same way every pass: no
    prefix cache); a step not seen before runs from the embedding. The layers see exactly the
    activations the whole forward gives them."""

    def __init__(self, model):
        self.model, self.states, self.start = model, {}, 0

    def run(self, layers: range):
        model, start, stop, seen, kept = self.model, self.start, layers[-1] + 1, self.states, {}

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            key = (input_ids.cpu().numpy().tobytes(), positions.cpu().numpy().tobytes())
            x, residual = seen.get(key, (None, None))
            first = start if x is not None else 0
            if x is None:
                x = model.embed_tokens(input_ids)
            for layer in model.layers[first:stop]:
                x, residual = layer(positions, x, residual)
            kept[key] = (x, residual)
            return x

        self.states, self.start = kept, stop
        return forward


def calibrate(llm, ids: list[int], chunk: int, keep: int, rows: bool = True, gram: bool = True,
              layers: range | None = None, carry: _Carry | None = None) -> dict[str, _Inputs]:
    """One pass of the engine over ``ids`` (prompts of ``chunk`` tokens) with hooks on the
    projections of ``layers`` (None: every layer). ``carry``: runs of layers taken in order start
    where the last one stopped (``_Carry``)."""
    model = llm.engine.runner.model
    inputs, handles = {}, []
    stride = max(1, len(ids) // keep)
    for i in range(len(model.layers)) if layers is None else layers:
        for p in _PROJ:
            name = f"layers.{i}.{p}"
            inputs[name] = _Inputs(stride, rows, gram)
            handles.append(model.get_submodule(name).register_forward_pre_hook(inputs[name]))
    from kvserve.sampling_params import SamplingParams
    if carry is not None and layers is not None:
        model.forward = carry.run(layers)
    try:
        prompts = [{"prompt_token_ids": ids[i:i + chunk]} for i in range(0, len(ids), chunk)]
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
        model.__dict__.pop("forward", None)
    return inputs


def quantize(model: str, out: str, method: str = "gptq", bits: int = 4, group_size: int = 128,
             symmetric: bool = True, act_order: bool = False, text: str | None = None, num_tokens: int = 16384,
             chunk: int = 512, device: str = "cpu", calibration_memory: int = CALIBRATION_MEMORY,
             observer: str | None = None) -> dict:
    """Quantize ``model`` (a GGUF file or an unquantized Hugging Face directory of a Llama-family
    model) and write the checkpoint to ``out`` (new or empty); returns its quantization_config.
    ``calibration_memory``: bytes the calibration statistics may hold at once (at least one
    layer's are held, whatever the bound). ``observer``: how each group's range is chosen
    (``algorithms.group_params``); None: ``mse`` for GPTQ, whose error feedback makes up for the
    weights it clips, ``minmax`` for RTN and AWQ, which have none (on Qwen2.5-Coder-0.5B at
    groups of 128, asymmetric, mse cut GPTQ's perplexity loss from +4.5% to +3.6% and raised
    RTN's from +5.4% to +10.8%)."""
    from kvserve.layers.linear import dense_parameters
    from kvserve.llm import LLM
    from kvserve.models import loader
    if observer is None:
        observer = "mse" if method == "gptq" else "minmax"
    check_args(method, bits, group_size, num_tokens, chunk, calibration_memory, observer)
    for name, flag in (("symmetric", symmetric), ("act_order", act_order)):
        if not isinstance(flag, bool):
            raise ConfigError(name, f"must be True or False, got {flag!r}")
    if act_order and method != "gptq":
        raise ConfigError("act_order", f"reorders GPTQ's columns; method {method} has no column order")
    if text is not None and not isinstance(text, str):
        raise ConfigError("text", f"must be the calibration text as a string (None: the default), got "
                          f"{type(text).__name__}")
    out = os.fspath(out) if isinstance(out, os.PathLike) else out
    if not isinstance(out, str) or not out.strip():
        raise ConfigError("out", f"must be the path of a new or empty directory; got {out!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ModelLoadError(f"{out}: exists and is not an empty directory; choose a new --out")
    _check_out(out)
    src = loader.resolve(model)
    if src.kind not in ("gguf", "hf") or src.quant_method or src.arch.family == "gemma3":
        why = ("already quantized" if src.quant_method else "a Gemma 3 model" if src.arch.family == "gemma3"
               else f"a {src.kind} source")
        raise ModelLoadError(f"{src.name}: {why}; kvserve quantize takes an unquantized Llama-family GGUF file "
                             f"or Hugging Face directory")
    llm = LLM(model, device=device, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              quantization="none", show_progress=False, max_num_batched_tokens=max(chunk, 512))
    eng, a = llm.engine, llm.engine.arch
    widths = set(a.projection_input_widths)
    if group_size and any(k % group_size for k in widths):
        shown = ", ".join(map(str, sorted(widths)))
        raise ConfigError("group_size", f"must divide every projection's input width ({shown} for {src.name}); "
                          f"{group_size} does not: use one of "
                          f"{', '.join(str(g) for g in INT4_GROUP_SIZES if not any(k % g for k in widths)) or 'none'}")
    if eng.tokenizer is None:
        raise ModelLoadError(f"{src.name}: no tokenizer to encode the calibration text")
    ids = eng.tokenizer.encode(default_text() if text is None else text, add_special_tokens=False)[:num_tokens]
    if len(ids) < 16:
        raise ConfigError("text", f"needs at least 16 tokens of calibration text, got {len(ids)}")
    chunk = min(chunk, eng.max_model_len - 1)  # each prompt leaves room for the token it generates
    # RTN needs no calibration; AWQ searches on input rows, GPTQ on X^T X.
    params = {k: v.detach().float().cpu() for k, v in dense_parameters(eng.runner.model)}
    grid = Grid(group_size, symmetric, torch.bfloat16 if src.kind == "gguf" else _hf_dtype(src.path), observer, bits)
    packed: dict[str, Quantized] = {}
    per_layer = max(1, _calibration_bytes(a, method))
    run = a.num_layers if method == "rtn" else max(1, min(a.num_layers, calibration_memory // per_layer))
    carry = _Carry(eng.runner.model)
    for first in range(0, a.num_layers, run):
        layers = range(first, min(a.num_layers, first + run))
        inputs = {} if method == "rtn" else calibrate(llm, ids, chunk, AWQ_ROWS, rows=method == "awq",
                                                        gram=method == "gptq", layers=layers, carry=carry)
        for i in layers:
            pre = f"layers.{i}."
            importance = _awq_layer(params, inputs, pre, a, grid) if method == "awq" else {}
            for p in _PROJ:
                w = params.pop(f"{pre}{p}.weight")
                if method == "gptq":
                    packed[pre + p] = algorithms.gptq(w, inputs[pre + p].gram, grid, act_order)
                else:
                    packed[pre + p] = algorithms.rtn(w, grid, importance=importance.get(p))
        del inputs
    config = _ct_config(bits, group_size, symmetric, act_order, observer)
    _write(out, src, eng, a, params, packed, config,
           {"method": method, "calibration_tokens": len(ids), "kvserve_version": kvserve_version()})
    return config


def _check_out(out: str) -> None:
    """Before any work: the directory the checkpoint is first written into (beside ``out``, see
    ``_write``) can be made, so that a path that cannot be written fails now, not after the
    quantization."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=_partial_prefix(out)))
    except OSError as e:
        raise ConfigError("out", f"cannot create the checkpoint directory {out!r} ({e.strerror or e})") from None


def _partial_prefix(out: str) -> str:
    return f".{os.path.basename(os.path.abspath(out))}.partial-"


def _awq_layer(params: dict, inputs: dict, pre: str, a, grid: Grid) -> dict[str, torch.Tensor]:
    """Search and fold AWQ's scales for one decoder layer (down first: its scale moves into
    up_proj's rows before gate_up is searched), into copies of the layer's tensors. Returns, per
    projection, the mean square of each input channel of the scaled layer (x / s): what a squared
    error in that column of the scaled weights costs the output (``algorithms.rtn``'s ``importance``)."""
    for k in [k for k in params if k.startswith(pre)]:
        params[k] = params[k].clone()
    inter = a.intermediate_size
    importance = {}
    w, x = params[pre + "mlp.down_proj.weight"], inputs[pre + "mlp.down_proj"].x()
    s = algorithms.awq_scales(w, x, grid)
    params[pre + "mlp.down_proj.weight"] = w * s
    importance["mlp.down_proj"] = (x / s).pow(2).mean(dim=0)
    params[pre + "mlp.gate_up_proj.weight"][inter:] /= s[:, None]
    # o_proj's input channel (head h, dim j) folds into v_proj's row (KV head h // group, j): under
    # grouped-query attention the heads of a group share one scale.
    d, group = a.head_dim, a.num_heads // a.num_kv_heads
    c = torch.arange(a.num_heads * d)
    tie = (c // d) // group * d + c % d
    w, x = params[pre + "self_attn.o_proj.weight"], inputs[pre + "self_attn.o_proj"].x()
    s = algorithms.awq_scales(w, x, grid, tie=tie if group > 1 else None)
    params[pre + "self_attn.o_proj.weight"] = w * s
    importance["self_attn.o_proj"] = (x / s).pow(2).mean(dim=0)
    sv = s.view(a.num_kv_heads, group, d)[:, 0].reshape(-1)
    kv = a.num_kv_heads * d
    qkv = params[pre + "self_attn.qkv_proj.weight"]
    qkv[qkv.shape[0] - kv:] /= sv[:, None]
    bias = params.get(pre + "self_attn.qkv_proj.bias")
    if bias is not None:
        bias[bias.shape[0] - kv:] /= sv
    for proj, norm in (("mlp.gate_up_proj", "post_attention_layernorm"), ("self_attn.qkv_proj", "input_layernorm")):
        w, x = params[f"{pre}{proj}.weight"], inputs[pre + proj].x()
        s = algorithms.awq_scales(w, x, grid)
        params[f"{pre}{proj}.weight"] = w * s
        params[f"{pre}{norm}.weight"] /= s
        importance[proj] = (x / s).pow(2).mean(dim=0)
    return importance


def _ct_config(bits: int, group_size: int, symmetric: bool, act_order: bool, observer: str) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group_size else "channel", "group_size": group_size or None,
               "dynamic": False, "actorder": "weight" if act_order else None, "observer": observer}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def pack_int32(codes: torch.Tensor, dim: int = 1, bits: int = 4) -> torch.Tensor:
    """Signed ``bits``-bit codes [R, C] (int8 in [-2^(b-1), 2^(b-1) - 1]) -> int32 words along
    ``dim``: value i of a run of 32 / b at bits b i, stored as q + 2^(b-1) (compressed-tensors'
    ``pack_to_int32``; b = 4 or 8, which divide a word)."""
    per = 32 // bits
    u = (codes.to(torch.int32) + (1 << (bits - 1)))
    if dim == 0:
        u = u.t()
    R, C = u.shape
    u = torch.nn.functional.pad(u, (0, -C % per)).view(R, -1, per)
    words = (u << torch.arange(0, 32, bits, dtype=torch.int32)).sum(dim=-1, dtype=torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def _write(out: str, src, eng, a, params: dict, packed: dict[str, Quantized], qconfig: dict, about: dict) -> None:
    dtype = torch.bfloat16 if src.kind == "gguf" else _hf_dtype(src.path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        for ours, parts in PARTS.items():  # a fused bias is split like its weight
            if name.endswith(f"{ours}.bias"):
                for part, rows in zip(parts, (t[r] for r in _row_ranges(a, ours))):
                    tensors["model." + name.replace(ours, part)] = rows.to(dtype).contiguous()
                break
        else:
            tensors[name if name.startswith("lm_head") else "model." + name] = t.to(dtype).contiguous()
    weights = qconfig["config_groups"]["group_0"]["weights"]
    bits = weights["num_bits"]
    for name, q in packed.items():
        ours = name.split(".", 2)[2]
        for part, rows in zip(PARTS[ours], _row_ranges(a, ours)):
            p = f"model.{name.replace(ours, part)}."
            tensors[p + "weight_packed"] = pack_int32(q.codes[rows], bits=bits)
            tensors[p + "weight_scale"] = q.scales[rows].contiguous()
            tensors[p + "weight_shape"] = torch.tensor([rows.stop - rows.start, q.codes.shape[1]], dtype=torch.int64)
            if not weights["symmetric"]:
                tensors[p + "weight_zero_point"] = pack_int32(q.zeros[rows], dim=0, bits=bits)
            if q.g_idx is not None:
                tensors[p + "weight_g_idx"] = q.g_idx.to(torch.int32)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=_partial_prefix(out))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would keep the checkpoint from other users
    try:
        _write_into(tmp, out, src, eng, tensors, qconfig, about, dtype, 0o666 & ~umask)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_into(tmp: str, out: str, src, eng, tensors: dict, qconfig: dict, about: dict, dtype,
                mode: int) -> None:
    """The checkpoint's files into ``tmp``, each readable as the umask allows (``mode``; the
    safetensors writer leaves its file 0600), then ``tmp`` renamed to ``out``."""
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    cfg = _hf_config(src)
    cfg["quantization_config"] = qconfig
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    if not cfg.get("architectures"):  # a GGUF's config names none; vLLM needs one
        cfg["architectures"] = [_ARCHITECTURES[src.arch.family]]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(tmp, "kvserve_quantize.json"), "w") as f:
        json.dump(about, f, indent=1)
    if src.kind == "hf" and os.path.exists(os.path.join(src.path, "generation_config.json")):
        shutil.copy(os.path.join(src.path, "generation_config.json"), tmp)  # a chat model's end-of-turn ids
    eng.tokenizer.save_pretrained(tmp)
    for name in os.listdir(tmp):
        if os.path.isfile(os.path.join(tmp, name)):
            os.chmod(os.path.join(tmp, name), mode)
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)


def _row_ranges(a, proj: str) -> list[slice]:
    q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    return {"self_attn.qkv_proj": [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)],
            "self_attn.o_proj": [slice(0, a.hidden_size)],
            "mlp.gate_up_proj": [slice(0, inter), slice(inter, 2 * inter)],
            "mlp.down_proj": [slice(0, a.hidden_size)]}[proj]


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _hf_dtype(path: str) -> torch.dtype:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def _hf_config(src) -> dict:
    if src.kind == "hf":
        with open(os.path.join(src.path, "config.json")) as f:
            return json.load(f)
    from transformers import AutoConfig  # the GGUF's metadata as a Hugging Face config
    cfg = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(src.path)),
                                     gguf_file=os.path.basename(src.path)).to_dict()
    cfg.pop("quantization_config", None)
    return cfg
