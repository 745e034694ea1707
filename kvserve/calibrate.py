"""Calibrated KV scales (``kvserve calibrate-kv``): a short run records, per layer and KV head,
the largest |K| (after RoPE, turned by the Hadamard matrix as the 8-bit caches store keys:
``kv_format.rotate_keys``) and |V| the model produces on a calibration text; fp8 and int8
caches then use one static scale per layer and head instead of a scale per token, so a block
holds codes only (exactly half of bf16) and nothing is computed per token to write one.

The file is saved beside the model (``<model.gguf>.kv_scales.json``, or ``kv_scales.json`` in a
Hugging Face directory) and loaded with it; ``--kv-scales PATH`` names another, ``off`` ignores it.
Values beyond the calibrated range are clipped to it: calibrate on text like what will be served.
"""
from __future__ import annotations

import difflib
import json
import os
import textwrap

import torch

from kvserve.errors import ConfigError
from kvserve.layers.kv_format import hadamard
from kvserve.models import loader

FORMAT = "kvserve-kv-scales"
VERSION = 2  # 2: keys' maxima measured turned (version 1 files measured them unturned)


def default_path(model: str | None) -> str | None:
    """Where a model's scales live beside it (None for dummy weights: give a path)."""
    src = loader.resolve(model)
    if src.kind == "dummy":
        return None
    if os.path.isdir(src.path):
        return os.path.join(src.path, "kv_scales.json")
    return src.path + ".kv_scales.json"


def default_text() -> str:
    """Calibration text that ships with Python: the docs of a few standard modules."""
    return "\n\n".join(m.__doc__ or "" for m in (textwrap, difflib, json, os))


class _Recorder:
    """Wraps the attention backend: notes max |K| (rotated and turned) and |V| per layer and KV head."""

    def __init__(self, inner, num_layers: int, num_kv_heads: int):
        self.inner, self.name = inner, inner.name
        self.layer_of: dict[int, int] = {}
        self.k_amax = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.v_amax = torch.zeros_like(self.k_amax)

    def prepare(self, meta, device):
        self.inner.prepare(meta, device)

    def forward(self, positions, q, k, v, rope, k_cache, v_cache, meta, scale):
        i = self.layer_of.setdefault(id(k_cache), len(self.layer_of))
        _, kr = rope(positions, q.clone(), k.clone())
        kr = hadamard(kr)
        self.k_amax[i] = torch.maximum(self.k_amax[i], kr.abs().amax(dim=(0, 2)).double().cpu())
        self.v_amax[i] = torch.maximum(self.v_amax[i], v.abs().amax(dim=(0, 2)).double().cpu())
        return self.inner.forward(positions, q, k, v, rope, k_cache, v_cache, meta, scale)


def calibrate(model: str | None = None, text: str | None = None, num_tokens: int = 2048, chunk: int = 512,
              output: str | None = None, **llm_kwargs) -> str:
    """Run ``num_tokens`` tokens of ``text`` through the model (full-precision KV) in prompts of
    ``chunk`` tokens; write and return the scales file."""
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams
    output = output or default_path(model)
    if output is None:
        raise ConfigError("output", "dummy weights have no place beside them: give --output PATH")
    llm = LLM(model, enforce_eager=True, show_progress=False, **llm_kwargs)
    eng = llm.engine
    a = eng.arch
    rec = _Recorder(eng.runner.backend, a.num_layers, a.num_kv_heads)
    eng.runner.backend = rec
    if eng.tokenizer is not None:
        ids = eng.tokenizer.encode(text or default_text(), add_special_tokens=False)
    else:  # dummy weights: random tokens are as good as any text
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, a.vocab_size, (num_tokens,), generator=g).tolist()
    ids = ids[:num_tokens]
    if len(ids) < 16:
        raise ConfigError("text", f"needs at least 16 tokens of calibration text, got {len(ids)}")
    prompts = [{"prompt_token_ids": ids[i:i + chunk]} for i in range(0, len(ids), chunk)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    if len(rec.layer_of) != a.num_layers:
        raise RuntimeError(f"saw {len(rec.layer_of)} attention layers, the model has {a.num_layers}")
    src = loader.resolve(model)
    doc = {"format": FORMAT, "version": VERSION, "model": src.name,
           "fingerprint": loader.fingerprint(src, llm.config.seed), "num_layers": a.num_layers,
           "num_kv_heads": a.num_kv_heads, "tokens": len(ids),
           "k_amax": rec.k_amax.tolist(), "v_amax": rec.v_amax.tolist()}
    tmp = output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, output)
    return output


def load(path: str, src: loader.ModelSource, seed: int, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The calibrated max |K| and |V| as [layers, 2, kv_heads] float32, checked against the model."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError("kv_scales", f"cannot read {path!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("kv_scales", f"{path}: not valid JSON ({e})") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        old = doc.get("format") == FORMAT and doc.get("version") == 1
        why = " (version 1 measured the keys unturned)" if old else ""
        raise ConfigError("kv_scales", f"{path}: not a {FORMAT} v{VERSION} file{why}: run kvserve calibrate-kv")
    fp = loader.fingerprint(src, seed)
    if doc.get("fingerprint") != fp:
        raise ConfigError("kv_scales", f"{path} was calibrated on other weights ({doc.get('model')}, "
                          f"{doc.get('fingerprint')}); this model is {src.name} ({fp}): recalibrate")
    amax = torch.tensor([doc["k_amax"], doc["v_amax"]], dtype=torch.float32).transpose(0, 1)
    if tuple(amax.shape) != (num_layers, 2, num_kv_heads) or not bool(torch.isfinite(amax).all()):
        raise ConfigError("kv_scales", f"{path}: scales of shape {tuple(amax.shape)}, the model needs "
                          f"({num_layers}, 2, {num_kv_heads}) finite values")
    return amax
