"""What a party that can read or write the disk directory (or the Redis server) can do: forged
chunks, chunks replayed under another key and chunks of another secret are never loaded, leave
the index at once and are written again; encrypted chunks do not give the prompt back; the
generated secret is private, outside the tier and the same for every process of the host."""
from __future__ import annotations

import hashlib
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tierutil import BLOCK, KV_SMALL, ONE, favor_loading, gen, prefix_keys

from kvserve.errors import ConfigError
from kvserve.kvtier import ChunkCodec
from kvserve.kvtier.secret import FILE_NAME, tier_secret
from kvserve.layers.linear import dense_parameters

_PREFIX = struct.Struct("<4sHI")


def _write_prefix(make_llm, prompts, kv_dir: str, **kw):
    """An engine that computed ``prompts.a`` and wrote its blocks through to ``kv_dir``."""
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir, **kw)
    gen(llm, prompts.a, ONE)
    llm.engine.store.flush()
    keys = prefix_keys(llm, prompts.prefix)
    assert all(k in llm.engine.store.disk for k in keys)
    return llm, keys


def _zeroed_and_resealed(data: bytes, key: bytes, i: int) -> bytes:
    """The chunk with its KV zeroed and a tag an attacker without the secret can make: a public
    hash of the bytes (what an unkeyed checksum accepts) or a MAC under the attacker's secret."""
    hlen = _PREFIX.unpack_from(data)[2]
    head = data[:_PREFIX.size + hlen]
    zeros = bytes(len(data) - len(head) - 32)
    if i % 2:
        return ChunkCodec(b"an attacker's own secret").encode(key, torch.zeros(2, 2, BLOCK, 2, 16))
    return head + zeros + hashlib.blake2b(head + zeros, digest_size=32).digest()


def test_forged_chunks_never_load_and_leave_the_index_at_once(make_llm, prompts, reference, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first, keys = _write_prefix(make_llm, prompts, kv_dir)
    disk = first.engine.store.disk
    forged = {}
    for i, k in enumerate(keys):
        path = Path(disk.path(k))
        forged[k] = _zeroed_and_resealed(path.read_bytes(), k, i)
        path.write_bytes(forged[k])
    del first

    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir)  # a restart: same secret, empty GPU
    favor_loading(llm)
    store = llm.engine.store
    ref_b, ref_c = reference(prompts.b, prompts.c)
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b
    assert out.metrics.num_loaded_tokens == 0
    # Every forged chunk of the prefix was found by this one request and dropped.
    assert store.disk.stats.corrupt == len(keys)
    assert store.load_stats.tokens_loaded["disk"] == 0
    # Recomputed and written through in their place, each now a chunk of this secret.
    store.flush()
    for k in keys:
        data = Path(store.disk.path(k)).read_bytes()
        assert data != forged[k]
        assert store.codec.decode(data, k, store.block_shape, store.dtype).abs().sum() > 0
    out = gen(llm, prompts.c)
    assert out.outputs[0].token_ids == ref_c
    llm.engine.check_invariants()


def test_chunk_replayed_under_another_key_is_refused(make_llm, prompts, reference, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first, keys = _write_prefix(make_llm, prompts, kv_dir)
    disk = first.engine.store.disk
    Path(disk.path(keys[0])).write_bytes(Path(disk.path(keys[1])).read_bytes())  # valid, for block 1
    del first

    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir)
    favor_loading(llm)
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert out.metrics.num_loaded_tokens == 0
    assert llm.engine.store.disk.stats.corrupt == 1


def test_another_secret_cannot_read_the_chunks(make_llm, prompts, reference, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first, keys = _write_prefix(make_llm, prompts, kv_dir, kv_tier_secret="the first host's secret")
    del first
    other = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir, kv_tier_secret="another host's secret")
    favor_loading(other)
    out = gen(other, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert out.metrics.num_loaded_tokens == 0
    assert other.engine.store.disk.stats.corrupt == len(keys)


def test_encrypted_chunks_load_after_a_restart(make_llm, prompts, reference, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first, keys = _write_prefix(make_llm, prompts, kv_dir, kv_tier_encrypt=True)
    del first
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir, kv_tier_encrypt=True)
    favor_loading(llm)
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert out.metrics.num_loaded_tokens == len(keys) * BLOCK
    assert llm.engine.store.disk.stats.corrupt == 0


def _layer0_values(llm) -> torch.Tensor:
    """Every vocabulary token's layer-0 V row ([vocab, kv heads * head dim]), from the weights
    with plain torch: what an attacker holding the open weights would match stored KV against."""
    m = llm.engine.runner.model
    arch = llm.engine.arch
    with torch.no_grad():
        e = m.embed_tokens.weight.float()
        x = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps)
        x = x * m.layers[0].input_layernorm.weight.float()
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        w_qkv = dict(dense_parameters(m))["layers.0.self_attn.qkv_proj.weight"]  # packed on the CPU
        w_v = w_qkv.float()[q + kv:q + 2 * kv]
        return x @ w_v.T


def _invert(data: bytes, values: torch.Tensor) -> set[int]:
    """The tokens whose V row appears in ``data``: every run of bytes, at every byte offset,
    read as float32 and matched to its nearest row (relative error below 1e-4)."""
    n = values.shape[1]
    found = set()
    for off in range(4):
        usable = (len(data) - off) // 4 * 4
        floats = torch.frombuffer(bytearray(data[off:off + usable]), dtype=torch.float32)
        if floats.numel() < n:
            continue
        windows = floats.unfold(0, n, 1).double()
        d = torch.cdist(windows, values.double())
        best, tok = d.min(dim=1)
        hit = best < 1e-4 * values.double().norm(dim=1)[tok]
        found.update(tok[hit].tolist())
    return found


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_encrypted_chunks_do_not_give_the_prompt_back(make_llm, prompts, tmp_path, encrypt):
    """The same inversion on both: plain chunks give back every token of their block (which is
    why they are sensitive); encrypted ones give back none."""
    llm, keys = _write_prefix(make_llm, prompts, str(tmp_path / "kv"), kv_tier_encrypt=encrypt)
    values = _layer0_values(llm)
    for i in range(3):
        data = Path(llm.engine.store.disk.path(keys[i])).read_bytes()
        found = _invert(data, values)
        block_tokens = set(prompts.prefix[i * BLOCK:(i + 1) * BLOCK])
        if encrypt:
            assert found == set()
        else:
            assert found == block_tokens


def test_generated_secret_is_private_outside_the_tier_and_shared_by_the_host(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("KVSERVE_STATE_DIR", str(state))
    monkeypatch.delenv("KVSERVE_KV_TIER_SECRET", raising=False)
    kv_dir = str(tmp_path / "kv")
    secret = tier_secret(None, kv_dir)
    path = state / FILE_NAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(secret) >= 32 and not path.is_relative_to(kv_dir)
    assert tier_secret(None, kv_dir) == secret
    code = "from kvserve.kvtier.secret import tier_secret; print(tier_secret(None).decode())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert p.stdout.strip().encode() == secret  # another process of the host: the same secret

    monkeypatch.setenv("KVSERVE_KV_TIER_SECRET", "a secret from the environment")
    assert tier_secret(None, kv_dir) == b"a secret from the environment"
    assert tier_secret("a secret given in the options", kv_dir) == b"a secret given in the options"
    monkeypatch.delenv("KVSERVE_KV_TIER_SECRET")

    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        tier_secret(None, kv_dir)
    with pytest.raises(ConfigError, match="16 characters"):
        tier_secret("short", kv_dir)
    monkeypatch.setenv("KVSERVE_STATE_DIR", os.path.join(kv_dir, "state"))
    with pytest.raises(ConfigError, match="inside disk_kv_dir"):
        tier_secret(None, kv_dir)
    assert not os.path.exists(os.path.join(kv_dir, "state"))
