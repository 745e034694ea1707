"""Kernel choices as configuration (``KernelConfig``): its defaults are the launchers', it is
validated, the step's layers read the backend's, and the Triton backend's table picks a route per
(phase, cache kind); the SM count is cached per device."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

pytest.importorskip("triton")

from kvserve import kernels  # noqa: E402
from kvserve import kv_format as kf
from kvserve.config import EngineConfig, KernelConfig  # noqa: E402
from kvserve.errors import ConfigError  # noqa: E402
from kvserve.kernels import common, gemv, kivi_decode  # noqa: E402
from kvserve.layers import linear  # noqa: E402
from kvserve.layers.attention import get_backend  # noqa: E402
from kvserve.layers.forward_context import AttentionMetadata, ForwardContext, forward_context, kernel_config  # noqa: E402
from kvserve.layers.triton_attention import ROUTES, cache_kind, step_phase  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals


def test_defaults_are_the_launchers():
    k = KernelConfig()
    assert EngineConfig().kernel == k
    assert (k.pdl, k.fused_rope_decode, k.kivi_gluon) == (True, True, True)
    assert (k.kivi_l2_ahead, k.kivi_wave) == (kivi_decode.L2_AHEAD, kivi_decode.WAVE)
    assert [k.gemv_max_rows(kind) for kind in ("linear", "gate_up_silu", "logits")] == [1, 32, 16]
    KernelConfig(gemv_max_rows_gate_up=gemv.MAX_ROWS)  # the kernel's limit is the config's
    with pytest.raises(ConfigError, match="gemv_max_rows_gate_up"):
        KernelConfig(gemv_max_rows_gate_up=gemv.MAX_ROWS + 1)


@pytest.mark.parametrize("kw,field", [(dict(pdl=1), "pdl"), (dict(kivi_gluon="yes"), "kivi_gluon"),
                                      (dict(gemv_max_rows_linear=-1), "gemv_max_rows_linear"),
                                      (dict(gemv_max_rows_logits=True), "gemv_max_rows_logits"),
                                      (dict(kivi_l2_ahead=-1), "kivi_l2_ahead"), (dict(kivi_wave=0), "kivi_wave"),
                                      (dict(wq_s8_min_rows=-1), "wq_s8_min_rows"),
                                      (dict(wq_s8_min_rows=64.0), "wq_s8_min_rows"),
                                      (dict(wq_s8_max_rows=0), "wq_s8_max_rows"),
                                      (dict(wq_fused_silu=None), "wq_fused_silu")])
def test_bad_values_are_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field):
        KernelConfig(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelConfig().pdl = False


def test_s8_rows_must_form_a_range():
    """A row range that no product falls in is refused, naming both bounds; min 0 is off."""
    with pytest.raises(ConfigError, match=r"wq_s8_min_rows.*wq_s8_max_rows \(512\), got 600"):
        KernelConfig(wq_s8_min_rows=600)
    assert KernelConfig(wq_s8_min_rows=512).wq_s8_min_rows == 512
    assert KernelConfig(wq_s8_min_rows=0, wq_s8_max_rows=1).wq_s8_min_rows == 0
    # a maximum below the default minimum (64) says how to get the range asked for
    with pytest.raises(ConfigError, match=r"wq_s8_max_rows \(32\), got 64.*or 0 to turn them off"):
        KernelConfig(wq_s8_max_rows=32)
    assert KernelConfig(wq_s8_min_rows=16, wq_s8_max_rows=32).wq_s8_max_rows == 32


def test_layers_follow_the_backend_of_the_step(monkeypatch):
    """The linear layers' row limits are the step's backend's; outside a step, the defaults."""
    monkeypatch.setattr(kernels, "available", lambda t: True)  # (the row rule, not the device)
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    assert kernel_config() == KernelConfig()
    assert linear.takes_gemv(x, w, "logits") and not linear.takes_gemv(x, w, "linear")
    off = KernelConfig(gemv_max_rows_logits=0, gemv_max_rows_linear=4, pdl=False)
    backend = get_backend("torch", off)
    with forward_context(ForwardContext(None, [], backend)) as ctx:
        assert ctx.kernel is off and kernel_config() is off
        assert not linear.takes_gemv(x, w, "logits") and linear.takes_gemv(x, w, "linear")
    assert kernel_config() == KernelConfig()
    assert get_backend("triton").kernel == KernelConfig()


def test_sm_count_per_device(monkeypatch):
    """Two GPUs with different SM counts keep their own (cached per device index)."""
    class Props:
        def __init__(self, n):
            self.multi_processor_count = n
    calls = []

    def props(index):
        calls.append(index)
        return Props({0: 132, 1: 78}[index])
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    common._sm_count.cache_clear()
    try:
        assert common.sm_count(torch.device("cuda", 1)) == 78
        assert common.sm_count(torch.device("cuda", 0)) == 132
        assert common.sm_count(torch.device("cuda", 1)) == 78 and calls == [1, 0]
        assert common.sm_count(torch.device("cpu")) == 4
    finally:
        common._sm_count.cache_clear()


def _meta(query_lens, seq_lens):
    qs = [0]
    for n in query_lens:
        qs.append(qs[-1] + n)
    return AttentionMetadata(slot_mapping=torch.zeros(qs[-1], dtype=torch.long), block_tables=torch.zeros(1, 1),
                             seq_lens=seq_lens, query_lens=query_lens, query_start=qs, block_size=16,
                             max_query_len=max(query_lens, default=0))


def test_route_table():
    """One route per (phase, cache kind) the backend can meet: decode, a lone whole prompt, and
    the rest; uncompressed, 8-bit and KIVI caches (and KIVI int4 through the Gluon kernel, on
    decode steps only). The RoPE + KV write folds into the attention kernel only on decode."""
    assert step_phase(_meta([1, 1], [30, 7])) == "decode"
    assert step_phase(_meta([12], [12])) == "prompt"
    assert step_phase(_meta([12], [40])) == "prefill"  # a chunk after cached context
    assert step_phase(_meta([12, 1], [12, 9])) == "prefill"  # mixed
    assert step_phase(_meta([], [])) == "prefill"
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    plain = torch.zeros(4, 16, 2, 128)
    views = {}
    for name in ("fp8", "int4", "int2"):
        f = kf.KVFormat(name, 2, 128, 64, torch.bfloat16)
        views[name] = f.views(torch.zeros(4, f.block_bytes, dtype=torch.uint8),
                              torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16))
    k = KernelConfig()
    assert cache_kind(plain, q, "decode", k) == "plain"
    assert cache_kind(views["fp8"], q, "decode", k) == "8bit"
    assert cache_kind(views["int2"], q, "decode", k) == "kivi"
    assert cache_kind(views["int4"], q, "decode", k) == "kivi"  # (the CPU: no Gluon kernel)
    phases, kinds = ("decode", "prompt", "prefill"), ("plain", "8bit", "kivi")
    assert {(p, c) for p in phases for c in kinds} | {("decode", "kivi4")} == set(ROUTES)
    assert {key for key, r in ROUTES.items() if r.fuses_write} == {("decode", "plain"), ("decode", "kivi4")}


def test_lone_prompt_attends_through_sdpa_only_into_a_compressed_cache(monkeypatch):
    """A lone whole prompt: the paged prefill kernel where the cache is plain; SDPA on its own
    full-precision K/V where the cache is compressed (the prefill kernel would read it back
    quantized)."""
    from kvserve.layers import triton_attention as ta
    called = []
    monkeypatch.setattr(ta, "paged_prefill_attention", lambda q, *a, **k: called.append("prefill") or q)
    monkeypatch.setattr(ta, "_sdpa_causal", lambda q, *a: called.append("sdpa") or q)
    monkeypatch.setattr(ta, "rope_kv_write", lambda *a, **k: None)
    monkeypatch.setattr(ta, "rope_kv_write_quant", lambda *a, **k: None)
    backend = get_backend("triton")
    T = 12
    q, k = torch.zeros(T, 8, 128), torch.zeros(T, 2, 128)
    plain = torch.zeros(4, 16, 2, 128)
    compressed = []
    for name in ("fp8", "int8", "int4", "int2"):
        f = kf.KVFormat(name, 2, 128, 64, torch.bfloat16)
        compressed.append(f.views(torch.zeros(4, f.block_bytes, dtype=torch.uint8),
                                  torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)))
    for cache, want in ((plain, "prefill"), *((c, "sdpa") for c in compressed)):
        meta = _meta([T], [T])
        backend.prepare(meta, torch.device("cpu"))
        rope = types.SimpleNamespace(cos=None, sin=None)
        backend.forward(torch.arange(T), q, k, k, rope, cache, cache if cache is plain else None, meta, 0.1)
        assert called.pop() == want and not called


def test_backend_passes_fused_rope_down(device, paged_kv):
    """A decode step through the Triton backend with ``fused_rope_decode`` on and off: the same
    cache, bit for bit (the fused kernel rounds as the separate write does), and the same output."""
    from kvserve.layers.rotary import RotaryEmbedding
    H, KVH, D, page = 4, 2, 32, 8
    seq_lens = [21, 1, 40]
    runs = []
    for on in (True, False):
        kc, vc, bt = paged_kv(torch.Generator().manual_seed(5), seq_lens, page, KVH, D, torch.float32, device)
        slots = torch.tensor([int(bt[b, (L - 1) // page]) * page + (L - 1) % page for b, L in enumerate(seq_lens)],
                             device=device)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=bt, seq_lens=seq_lens, query_lens=[1] * 3,
                                 query_start=[0, 1, 2, 3], block_size=page)
        backend = get_backend("triton", KernelConfig(fused_rope_decode=on))
        backend.prepare(meta, device)
        qkv = torch.randn(3, (H + 2 * KVH) * D, generator=torch.Generator().manual_seed(9)).to(device)
        q, k, v = (t.view(3, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        positions = torch.tensor([L - 1 for L in seq_lens], device=device)
        rope = RotaryEmbedding(D, 64, 10000.0).to(device)
        out = backend.forward(positions, q, k, v, rope, kc, vc, meta, D ** -0.5)
        runs.append((out, kc, vc))
    (o1, k1, v1), (o2, k2, v2) = runs
    assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.nan_to_num(), v2.nan_to_num())
    assert not o1.isnan().any()
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
