"""Snapshots: written from the default model and dummies, read back by safetensors and xxhash,
loaded into engines that give the same greedy tokens and log-probs; every refusal."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import xxhash
from safetensors.torch import load_file

import kvserve
from kvserve.cli import build_parser, main
from kvserve.engine import startup
from kvserve.errors import ModelLoadError
from kvserve.layers.linear import dense_parameters
from kvserve.llm import LLM
from kvserve.models import snapshot
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
TINY_PROMPTS = [[7, 3, 99, 250, 11], [400, 2, 2, 5, 17, 300, 41]]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _outputs(llm: LLM, prompts) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _tiny(model: str = "dummy:tiny", **kw) -> LLM:
    return LLM(model, kv_cache_memory="16MiB", show_progress=False, **kw)


@pytest.fixture(scope="module")
def tiny_snapshot(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("snap") / "tiny")
    llm = _tiny()
    snapshot.write(llm.engine, out)
    return out, _outputs(llm, TINY_PROMPTS), llm


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The default model (GGUF, Q4_1 dequantized to float32), its snapshot and their outputs."""
    out = str(tmp_path_factory.mktemp("snap") / "smol")
    llm = LLM(kv_cache_memory="64MiB", show_progress=False, quantization="none")
    prompts = [{"prompt_token_ids": llm.apply_chat_template(CHAT)}, "The quick brown fox"]
    snapshot.write(llm.engine, out)
    return out, prompts, llm


@pytest.mark.slow
def test_default_model_round_trip(smol, hf_model):
    out, prompts, orig = smol
    snap = LLM(out, kv_cache_memory="64MiB", show_progress=False)
    assert _outputs(snap, prompts) == _outputs(orig, prompts)
    tok, ref_tok = snap.get_tokenizer(), orig.get_tokenizer()
    assert tok.chat_template == ref_tok.chat_template
    assert snap.apply_chat_template(CHAT) == orig.apply_chat_template(CHAT)
    assert tok.encode("Snapshots keep the tokenizer.") == ref_tok.encode("Snapshots keep the tokenizer.")
    # The fused matrices are transformers' own q/k/v and gate/up rows, stacked.
    files = json.load(open(os.path.join(out, snapshot.MANIFEST)))["files"]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(out, f)))
    hf = dict(hf_model.named_parameters())
    for i in (0, 29):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(tensors[f"layers.{i}.self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        assert torch.equal(tensors[f"layers.{i}.mlp.gate_up_proj.weight"], gate_up)


def test_manifest_checksums_and_tensors(tiny_snapshot):
    out, _, llm = tiny_snapshot
    m = json.load(open(os.path.join(out, snapshot.MANIFEST)))
    assert m["format_version"] == snapshot.FORMAT_VERSION and m["dtype"] == "float32"
    assert m["device"] == {"kind": "cpu"} and m["checksum"] == "xxh3_128"
    params = dict(dense_parameters(llm.engine.runner.model))  # the CPU engine's projections are packed
    seen = {}
    block = m["checksum_block_bytes"]
    for fname, entry in m["files"].items():
        path = os.path.join(out, fname)
        data = open(path, "rb").read()
        assert entry["blocks"] == [xxhash.xxh3_128(data[i:i + block]).hexdigest() for i in range(0, len(data), block)]
        assert os.path.getsize(path) == entry["bytes"]
        seen.update(load_file(path))
    assert seen.keys() == params.keys()
    assert all(torch.equal(seen[k], params[k].detach()) for k in params)


def test_dummy_round_trip(tiny_snapshot):
    out, ref, _ = tiny_snapshot
    assert _outputs(_tiny(out), TINY_PROMPTS) == ref


def test_bfloat16_snapshot_runs_in_its_dtype(tmp_path):
    out = str(tmp_path / "bf16")
    src = _tiny(dtype="bfloat16")
    snapshot.write(src.engine, out)
    snap = _tiny(out)
    assert snap.engine.runner.dtype == torch.bfloat16
    assert _outputs(snap, TINY_PROMPTS) == _outputs(src, TINY_PROMPTS)
    with pytest.raises(ModelLoadError, match="holds bfloat16 weights, dtype float32 was asked for"):
        _tiny(out, dtype="float32")


def test_kv_cache_dtype_is_the_snapshots_default(tmp_path):
    out = str(tmp_path / "int8kv")
    src = _tiny(kv_cache_dtype="int8")
    snapshot.write(src.engine, out)
    snap = _tiny(out)
    assert snap.config.cache.kv_cache_dtype == "int8"
    assert snap.config.cache.block_size == src.config.cache.block_size
    assert _outputs(snap, TINY_PROMPTS) == _outputs(src, TINY_PROMPTS)
    assert _tiny(out, kv_cache_dtype="fp8").config.cache.kv_cache_dtype == "fp8"  # an explicit one wins


def test_cli_writes_a_snapshot_the_server_args_load(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert main(["snapshot", "dummy:tiny", "--out", out, "--kv-cache-memory", "16MiB"]) == 0
    assert "snapshot of dummy:tiny written" in capsys.readouterr().out
    assert snapshot.is_snapshot(out)
    assert json.load(open(os.path.join(out, snapshot.MANIFEST)))["kvserve_version"] == kvserve.__version__
    assert build_parser().parse_args(["serve", out]).model_path == out
    assert main(["snapshot", "dummy:tiny", "--out", out, "--kv-cache-memory", "16MiB"]) == 2  # not empty
    assert "not an empty directory" in capsys.readouterr().err


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(path: str, **changes) -> None:
    mpath = os.path.join(path, snapshot.MANIFEST)
    m = json.load(open(mpath))
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(m.get(k), dict):
            m[k].update(v)
        else:
            m[k] = v
    json.dump(m, open(mpath, "w"))


def _shard(path: str) -> str:
    return os.path.join(path, "model-00000.safetensors")


@pytest.mark.parametrize("damage, message", [
    (lambda p: _edit_manifest(p, format_version=1), "snapshot format version 1"),
    (lambda p: _edit_manifest(p, format_version=None), "snapshot format version None"),
    (lambda p: open(os.path.join(p, snapshot.MANIFEST), "w").write("{not json"), "not a readable snapshot manifest"),
    (lambda p: _edit_manifest(p, device={"kind": "cuda", "arch": "sm_90", "name": "NVIDIA H200"}),
     "written for cuda sm_90 .NVIDIA H200.; this device is cpu"),
    (lambda p: _edit_manifest(p, arch={"hidden_size": 96}), "does not match the model its manifest describes"),
    (lambda p: _edit_manifest(p, arch={"num_layers": 3}), "lacks"),
    (lambda p: _edit_manifest(p, arch={"family": "falcon", "bogus": 1}), "model description is invalid"),
    (lambda p: os.remove(_shard(p)), "missing; the snapshot is incomplete"),
    (lambda p: os.truncate(_shard(p), os.path.getsize(_shard(p)) - 100), "the manifest says"),
    (lambda p: _edit_manifest(p, checksum_block_bytes=0), "checksum_block_bytes is 0, not a positive integer"),
    (lambda p: _edit_manifest(p, files={"model-00000.safetensors": {"bytes": float(os.path.getsize(_shard(p)))}}),
     "has no integer size"),
    (lambda p: _edit_manifest(p, checksum_block_bytes=1000), "block checksums do not cover"),
    (lambda p: _edit_manifest(p, files={"model-00000.safetensors": {"bytes": os.path.getsize(_shard(p)),
                                                                     "blocks": None}}),
     "block checksums do not cover"),
])
def test_refused_snapshots(tiny_snapshot, tmp_path, damage, message):
    path = _copy(tiny_snapshot[0], tmp_path / "s")
    damage(path)
    with pytest.raises(ModelLoadError, match=message):
        _tiny(path)


def test_changed_bytes_fail_the_checksum(tiny_snapshot, tmp_path):
    path = _copy(tiny_snapshot[0], tmp_path / "s")
    size = os.path.getsize(_shard(path))
    with open(_shard(path), "r+b") as f:  # one byte of a weight, past the header: same size, valid file
        f.seek(size - 5)
        b = f.read(1)
        f.seek(size - 5)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(ModelLoadError, match="checksum does not match the manifest"):
        _tiny(path)


def test_write_refuses_a_non_empty_directory(tiny_snapshot, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        snapshot.write(tiny_snapshot[2].engine, str(tmp_path))
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def sharded_snapshot(tmp_path_factory):
    """The tiny model's snapshot over several small shards (several read at once at load)."""
    out = str(tmp_path_factory.mktemp("snap") / "sharded")
    llm = _tiny()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapshot, "SHARD_BYTES", 40_000)
        snapshot.write(llm.engine, out)
    return out, _outputs(llm, TINY_PROMPTS)


def test_sharded_round_trip_and_startup_phases(sharded_snapshot, caplog):
    out, ref = sharded_snapshot
    files = json.load(open(os.path.join(out, snapshot.MANIFEST)))["files"]
    assert len(files) >= 4
    with caplog.at_level("INFO", logger="kvserve.engine.llm_engine"):
        llm = _tiny(out)
    assert _outputs(llm, TINY_PROMPTS) == ref
    times = llm.engine.startup_seconds
    assert {"tokenizer", "build", "weights", "kv_cache", "total"} <= times.keys()
    assert all(v >= 0 for v in times.values()) and times["weights"] < times["total"]
    assert sum("started in" in r.getMessage() for r in caplog.records) == 1


def test_the_triton_compiler_key_is_left_in_tritons_cache():
    """Start-up hashes Triton's compiler on a thread of its own: the first kernel launch must
    find the key in Triton's own cache rather than hash the library again."""
    import triton
    from triton.runtime import cache
    cache.triton_key.cache_clear()
    startup.triton_compiler_key()
    info = cache.triton_key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    assert cache.triton_key().startswith(triton.__version__) and cache.triton_key.cache_info().hits == 1


def test_a_changed_byte_in_one_shard_names_it(sharded_snapshot, tmp_path):
    path = _copy(sharded_snapshot[0], tmp_path / "s")
    shard = os.path.join(path, "model-00002.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2 + 1000)  # in the data, past the header
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ModelLoadError, match="model-00002.safetensors: checksum does not match the manifest"):
        _tiny(path)


def test_a_shard_cut_short_fails_even_when_the_manifest_agrees(sharded_snapshot, tmp_path):
    path = _copy(sharded_snapshot[0], tmp_path / "s")
    shard = os.path.join(path, "model-00001.safetensors")
    os.truncate(shard, os.path.getsize(shard) - 8)
    _edit_manifest(path, files={"model-00001.safetensors": {"bytes": os.path.getsize(shard),
                                                             "blocks": ["0" * 32]}})
    with pytest.raises(ModelLoadError, match="model-00001.safetensors: corrupt or truncated safetensors file"):
        _tiny(path)


def test_small_checksum_blocks_round_trip_and_name_the_damaged_range(tmp_path):
    """Many blocks per file (the loading threads share them): the output is the same, and a
    changed byte is reported with the byte range of its block."""
    llm = _tiny()
    ref = _outputs(llm, TINY_PROMPTS)
    out = str(tmp_path / "blocks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapshot, "HASH_BLOCK_BYTES", 7_001)  # not a divisor of anything: blocks cut tensors
        m = snapshot.write(llm.engine, out)
    assert m["checksum_block_bytes"] == 7_001
    assert all(len(e["blocks"]) == -(-e["bytes"] // 7_001) > 3 for e in m["files"].values())
    assert _outputs(_tiny(out), TINY_PROMPTS) == ref
    shard = _shard(out)
    at = 3 * 7_001 + 17
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ModelLoadError, match=f"checksum does not match the manifest .bytes {3 * 7_001} to {4 * 7_001}"):
        _tiny(out)
