"""Embeddings (LLM.embed) against transformers' own Llama on the same GGUF weights: the final
hidden states, mean- or last-token-pooled and L2-normalised, agree within 1e-4 per dimension."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Memory decides what inference costs. " * 12, "Hi"]


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, kv_cache_memory="64MiB")


def reference(hf_model, ids: list[int], how: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(h.mean(0) if how == "mean" else h[-1], dim=0)


@pytest.mark.parametrize("how", ["mean", "last"])
def test_pooled_hidden_states_match_transformers(llm, hf_model, tokenizer, how):
    got = llm.embed(TEXTS, how)
    assert len(got) == len(TEXTS)
    for text, vec in zip(TEXTS, got):
        ref = reference(hf_model, tokenizer.encode(text, add_special_tokens=True), how)
        v = torch.tensor(vec)
        assert v.shape == ref.shape and torch.linalg.vector_norm(v).item() == pytest.approx(1.0, abs=1e-5)
        assert (v - ref).abs().max().item() < 1e-4
    # different texts, different vectors (the pooling does not wash the input out)
    assert torch.dot(torch.tensor(got[0]), torch.tensor(got[2])).item() < 0.99


def test_bad_prompts_name_the_field(model_path):
    """Validation needs no real weights: dummy:tiny with the default model's tokenizer."""
    from kvserve.errors import InvalidRequestError
    llm = LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False)
    with pytest.raises(InvalidRequestError, match="prompts\\[1\\]"):
        llm.embed([[5, 17], [1, 2, 10**9]])
    with pytest.raises(InvalidRequestError, match="prompts\\[0\\]: must not be empty"):
        llm.embed([""])
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("x", "max")
