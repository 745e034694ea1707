"""Calibrated KV scales on disk: where a model's file lives and how it is read back and checked
(``kvserve calibrate-kv`` writes it: ``kvserve/calibrate.py``). Per layer and KV head, the largest
|K| (after RoPE, turned by the Hadamard matrix as the 8-bit caches store keys:
``kv_format.rotate_keys``) and |V| the model produced on a calibration text; fp8 and int8 caches
then use one static scale per layer and head instead of a scale per token.

The file sits beside the model (``<model.gguf>.kv_scales.json``, or ``kv_scales.json`` in a
Hugging Face directory); ``--kv-scales PATH`` names another, ``off`` ignores it.
"""
from __future__ import annotations

import json
import os

import torch

from kvserve.errors import ConfigError
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
