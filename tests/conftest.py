"""Shared fixtures: the default model's path, its tokenizer, and Hugging Face's reference model."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))
# Without a GPU, Triton kernels run in its interpreter (tests/kernels call them on CPU tensors).
# Set before anything imports triton: the decorator reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvserve.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own Llama on the same GGUF weights, float32: the reference we did not write."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                             dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from kvserve.tokenizer import load_tokenizer
    return load_tokenizer("gguf", model_path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Reference continuation: one prompt at a time, no padding."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, len(prompt_ids):].tolist()
