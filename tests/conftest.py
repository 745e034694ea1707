"""Shared fixtures (the default model's path, its tokenizer, Hugging Face's reference model) and
the test tiers.

Tiers (``pytest -m``, registered in pyproject.toml): every test is one of

    unit     pure bookkeeping, no model: the files in ``UNIT_FILES``
    kernels  a Triton kernel against its reference: everything under tests/kernels/
    e2e      builds a whole engine or starts a server: everything else

unless it carries one of these marks itself. ``gpu`` is added to tests that need CUDA (test_cuda.py,
and any test whose skip reason names CUDA); ``slow`` is written on the slowest tests themselves.
The inner loop is ``bash scripts/test.sh -m "not slow"``; CI runs every tier.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))
# Without a GPU, Triton kernels run in its interpreter (tests/kernels call them on CPU tensors).
# Set before anything imports triton: the decorator reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "kernels", "e2e")
UNIT_FILES = {"test_block_pool.py", "test_sampler.py", "test_scheduler_properties.py", "test_stop_strings.py",
              "kvtier/test_chunk.py", "kvtier/test_tier_lru_properties.py"}
GPU_FILES = {"test_cuda.py"}


def _tier(rel: str) -> str:
    if rel.startswith("kernels/"):
        return "kernels"
    return "unit" if rel in UNIT_FILES else "e2e"


def _needs_cuda(item: pytest.Item, rel: str) -> bool:
    return rel in GPU_FILES or any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        rel = path.relative_to(TESTS).as_posix()
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(_tier(rel))
        if _needs_cuda(item, rel):
            item.add_marker("gpu")


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
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, len(prompt_ids):].tolist()
