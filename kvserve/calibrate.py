"""Calibrated KV scales (``kvserve calibrate-kv``): a short run records, per layer and KV head,
the largest |K| (after RoPE, turned by the Hadamard matrix as the 8-bit caches store keys:
``kv_format.rotate_keys``) and |V| the model produces on a calibration text; fp8 and int8
caches then use one static scale per layer and head instead of a scale per token, so a block
holds codes only (exactly half of bf16) and nothing is computed per token to write one.

The file is saved beside the model and loaded with it (``kvserve/kv_scales.py``: where it lives,
how it is read back and checked). Values beyond the calibrated range are clipped to it: calibrate
on text like what will be served.
"""
from __future__ import annotations

import difflib
import json
import os
import textwrap

import torch

from kvserve.errors import ConfigError
from kvserve.kv_format import hadamard
from kvserve.kv_scales import FORMAT, VERSION, default_path, load  # noqa: F401  (the file's format)
from kvserve.models import loader


def default_text() -> str:
    """Calibration text that ships with Python: the docs of a few standard modules."""
    return "\n\n".join(m.__doc__ or "" for m in (textwrap, difflib, json, os))


class _Recorder:
    """Wraps the attention backend: notes max |K| (rotated and turned) and |V| per layer and KV head."""

    def __init__(self, inner, num_layers: int, num_kv_heads: int):
        self.inner, self.name, self.kernel = inner, inner.name, inner.kernel
        self.layer_of: dict[int, int] = {}
        self.k_amax = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.v_amax = torch.zeros_like(self.k_amax)

    def prepare(self, meta, device):
        self.inner.prepare(meta, device)

    def forward(self, positions, q, k, v, rope, k_cache, v_cache, meta, scale, window=None):
        i = self.layer_of.setdefault(id(k_cache), len(self.layer_of))
        _, kr = rope(positions, q.clone(), k.clone())
        kr = hadamard(kr)
        self.k_amax[i] = torch.maximum(self.k_amax[i], kr.abs().amax(dim=(0, 2)).double().cpu())
        self.v_amax[i] = torch.maximum(self.v_amax[i], v.abs().amax(dim=(0, 2)).double().cpu())
        return self.inner.forward(positions, q, k, v, rope, k_cache, v_cache, meta, scale, window=window)


def calibrate(model: str | None = None, text: str | None = None, num_tokens: int = 2048, chunk: int = 512,
              output: str | None = None, **llm_kwargs) -> str:
    """Run ``num_tokens`` tokens of ``text`` through the model (full-precision KV) in prompts of
    ``chunk`` tokens; write and return the scales file."""
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams
    if llm_kwargs.get("tensor_parallel_size", 1) != 1:  # the recorder sees rank 0's KV heads only
        raise ConfigError("tensor_parallel_size", "calibration runs on one rank; leave it at 1")
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
