"""``attention_backend="auto"`` (``engine/device.choose_attention_backend``): Triton on CUDA with
no eviction or streaming eviction (its kernels skip the evicted span), the PyTorch path on the
CPU and for SnapKV and H2O (which need its attention scores); an explicit backend is kept. Whether
Triton is installed is asked only on CUDA."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.engine.device import choose_attention_backend


def _never() -> bool:
    raise AssertionError("has_triton asked off CUDA")


@pytest.mark.parametrize("eviction,want", [("none", "triton"), ("streaming", "triton"),
                                           ("snapkv", "torch"), ("h2o", "torch")])
def test_auto_on_cuda(eviction, want):
    assert choose_attention_backend("auto", "cuda", eviction, lambda: True) == want
    assert choose_attention_backend("auto", "cuda", eviction, lambda: False) == "torch"


@pytest.mark.parametrize("eviction", ["none", "streaming", "snapkv", "h2o"])
def test_auto_on_cpu_is_torch(eviction):
    assert choose_attention_backend("auto", "cpu", eviction, _never) == "torch"


@pytest.mark.parametrize("requested", ["torch", "triton"])
def test_explicit_backend_is_kept(requested):
    assert choose_attention_backend(requested, "cuda", "streaming", _never) == requested
    assert choose_attention_backend(requested, "cpu", "none", _never) == requested


@pytest.mark.parametrize("eviction", ["none", "streaming"])
def test_cpu_engine_runs_on_torch(eviction):
    llm = LLM("dummy:tiny", device="cpu", kv_cache_memory="1MiB", max_model_len=64, show_progress=False,
              kv_eviction=eviction)
    assert llm.engine.runner.backend_name == "torch"
