"""Bad input: sampling parameters, model paths and files, requests. Each error names what is
wrong (field / file) and what is allowed; a bad request never disturbs the others."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvserve import LLM
from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams

# -- SamplingParams ----------------------------------------------------------------------------

BAD_PARAMS = [
    # (kwargs, field, substrings the message must contain)
    (dict(max_tokens=0), "max_tokens", ["[1, 2147483647]", "0"]),
    (dict(max_tokens=-5), "max_tokens", ["[1, 2147483647]", "-5"]),
    (dict(temperature=-0.1), "temperature", ["[0, 2]", "-0.1"]),
    (dict(temperature=float("nan")), "temperature", ["[0, 2]"]),
    (dict(top_p=0), "top_p", ["(0, 1]"]),
    (dict(top_p=0.0), "top_p", ["(0, 1]"]),
    (dict(top_p=1.5), "top_p", ["(0, 1]", "1.5"]),
    (dict(top_p=-0.5), "top_p", ["(0, 1]"]),
    (dict(top_k=-2), "top_k", ["-1", "0", "positive", "-2"]),
    (dict(n=0), "n", ["[1, 128]", "0"]),
    (dict(n=-1), "n", ["[1, 128]"]),
    (dict(min_p=-0.01), "min_p", ["[0, 1]"]),
    (dict(min_p=1.01), "min_p", ["[0, 1]", "1.01"]),
    (dict(logprobs=-1), "logprobs", [f"[0, {MAX_LOGPROBS}]", "-1"]),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", [f"[0, {MAX_LOGPROBS}]", str(MAX_LOGPROBS + 1)]),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs", [f"[0, {MAX_LOGPROBS}]"]),
    (dict(min_tokens=10, max_tokens=5), "min_tokens", ["<= max_tokens", "5", "10"]),
    (dict(min_tokens=-1), "min_tokens", ["[0, 2147483647]"]),
    (dict(repetition_penalty=0), "repetition_penalty", ["(0, 100]"]),
    (dict(presence_penalty=2.5), "presence_penalty", ["[-2, 2]"]),
    (dict(frequency_penalty=-3), "frequency_penalty", ["[-2, 2]"]),
    (dict(stop=["ok", ""]), "stop", ["non-empty"]),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids", ["non-negative"]),
]


@pytest.mark.parametrize("kwargs,field,parts", BAD_PARAMS, ids=[f"{b[1]}={list(b[0].values())}" for b in BAD_PARAMS])
def test_sampling_params_errors_name_field_and_range(kwargs, field, parts):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kwargs)
    e = ei.value
    assert e.field == field
    msg = str(e)
    assert msg.startswith(f"{field}: ")
    for p in parts:
        assert p in msg, (p, msg)
    assert isinstance(e, ValueError)  # callers may catch broadly


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(temperature=0), dict(top_p=1.0), dict(top_p=1e-6),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(n=1), dict(min_p=0.0), dict(min_p=1.0),
    dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(min_tokens=5, max_tokens=5),
    dict(min_tokens=100, max_tokens=None),
])
def test_sampling_params_edges_accepted(kwargs):
    SamplingParams(**kwargs)


# -- model paths and files ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_gguf():
    from kvserve.models.loader import default_model_path
    return default_model_path()


def _resolve_error(path) -> str:
    from kvserve.models.loader import resolve
    with pytest.raises(ModelLoadError) as ei:
        resolve(str(path))
    return str(ei.value)


def test_nonexistent_path(tmp_path):
    p = tmp_path / "no" / "such" / "model.gguf"
    msg = _resolve_error(p)
    assert str(p) in msg and "does not exist" in msg


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    msg = _resolve_error(tmp_path)
    assert str(tmp_path) in msg and "config.json" in msg


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    msg = _resolve_error(tmp_path)
    assert str(tmp_path / "config.json") in msg and "JSON" in msg


def test_unsupported_architecture(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = _resolve_error(tmp_path)
    assert str(tmp_path / "config.json") in msg
    assert "GPT2LMHeadModel" in msg and "unsupported" in msg
    assert "LlamaForCausalLM" in msg  # says what is supported


def test_config_missing_field(tmp_path):
    from kvserve.models.presets import DUMMY_PRESETS
    cfg = dict(DUMMY_PRESETS["tiny"])
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = _resolve_error(tmp_path)
    assert str(tmp_path / "config.json") in msg and "hidden_size" in msg


@pytest.mark.parametrize("nbytes", [4096, 24, 0])
def test_truncated_gguf(tmp_path, default_gguf, nbytes):
    p = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        p.write_bytes(f.read(nbytes))
    msg = _resolve_error(p)
    assert str(p) in msg and "GGUF" in msg


def test_gguf_truncated_in_tensor_data(tmp_path, default_gguf):
    p = tmp_path / "cut.gguf"
    size = os.path.getsize(default_gguf)
    with open(default_gguf, "rb") as src, open(p, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    with open(p, "r+b") as f:
        f.truncate(int(size * 0.9))
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=str(p), show_progress=False, kv_cache_memory="64MiB")
    assert str(p) in str(ei.value)


def test_random_bytes_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(torch.randint(0, 256, (8192,), generator=torch.Generator().manual_seed(0),
                                dtype=torch.uint8).numpy().tobytes())
    msg = _resolve_error(p)
    assert str(p) in msg and "GGUF" in msg


def test_truncated_gguf_through_llm(tmp_path, default_gguf):
    p = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        p.write_bytes(f.read(4096))
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=str(p), show_progress=False, kv_cache_memory="64MiB")
    assert str(p) in str(ei.value)


def _tiny_hf_dir(path) -> str:
    """A tiny Llama in Hugging Face format: config.json + model.safetensors (no tokenizer)."""
    from safetensors.torch import save_file

    from kvserve.models.arch import ModelArch
    from kvserve.models.presets import DUMMY_PRESETS
    cfg = dict(DUMMY_PRESETS["tiny"], model_type="llama")
    a = ModelArch.from_hf_config(cfg)
    g = torch.Generator().manual_seed(0)
    h, i, hd = a.hidden_size, a.intermediate_size, a.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    t = {"model.embed_tokens.weight": w(a.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for layer in range(a.num_layers):
        pre = f"model.layers.{layer}."
        t |= {pre + "self_attn.q_proj.weight": w(a.num_heads * hd, h),
              pre + "self_attn.k_proj.weight": w(a.num_kv_heads * hd, h),
              pre + "self_attn.v_proj.weight": w(a.num_kv_heads * hd, h),
              pre + "self_attn.o_proj.weight": w(h, a.num_heads * hd),
              pre + "mlp.gate_proj.weight": w(i, h), pre + "mlp.up_proj.weight": w(i, h),
              pre + "mlp.down_proj.weight": w(h, i),
              pre + "input_layernorm.weight": torch.ones(h),
              pre + "post_attention_layernorm.weight": torch.ones(h)}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(t, os.path.join(path, "model.safetensors"))
    return str(path)


def test_tiny_hf_dir_loads(tmp_path):
    """The control for the corrupt-safetensors tests: intact, the same directory loads and runs."""
    d = _tiny_hf_dir(tmp_path / "tiny")
    llm = LLM(model=d, show_progress=False, kv_cache_memory="64MiB")
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("keep", ["half", "all_but_one", "100", "3"])
def test_truncated_safetensors(tmp_path, keep):
    d = _tiny_hf_dir(tmp_path / "tiny")
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    n = {"half": size // 2, "all_but_one": size - 1, "100": 100, "3": 3}[keep]
    with open(f, "r+b") as fh:
        fh.truncate(n)
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=d, show_progress=False, kv_cache_memory="64MiB")
    assert f in str(ei.value)


def test_garbage_safetensors(tmp_path):
    d = _tiny_hf_dir(tmp_path / "tiny")
    f = os.path.join(d, "model.safetensors")
    with open(f, "wb") as fh:
        fh.write(os.urandom(4096))
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=d, show_progress=False, kv_cache_memory="64MiB")
    assert f in str(ei.value)


def test_no_safetensors_files(tmp_path):
    d = _tiny_hf_dir(tmp_path / "tiny")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError) as ei:
        LLM(model=d, show_progress=False, kv_cache_memory="64MiB")
    assert d in str(ei.value) and "safetensors" in str(ei.value)


def test_unknown_dummy_preset():
    with pytest.raises(ModelLoadError) as ei:
        LLM(model="dummy:nope", show_progress=False, kv_cache_memory="16MiB")
    assert "nope" in str(ei.value) and "tiny" in str(ei.value)


def test_model_paths_and_config_objects_of_the_wrong_type():
    """A pathlib path is a path; another type for the model, a dict for the kernel choices or a
    method name where the engine config takes a QuantConfig is refused naming the field."""
    import pathlib

    from kvserve.config import EngineConfig
    from kvserve.errors import ConfigError
    with pytest.raises(ModelLoadError, match="model path '/nonexistent/m' does not exist"):
        LLM(model=pathlib.Path("/nonexistent/m"), show_progress=False)
    with pytest.raises(ModelLoadError, match="model must be a path or dummy:<preset> string; got int"):
        LLM(model=3, show_progress=False)
    with pytest.raises(ConfigError, match="kernel: must be a KernelConfig, got dict"):
        LLM(model="dummy:tiny", kernel={"wq_split_k": False}, show_progress=False)
    with pytest.raises(ConfigError, match="quantization: must be a QuantConfig or None"):
        EngineConfig(model="dummy:tiny", quantization="int4")
    assert EngineConfig(model=pathlib.Path("/m")).model == "/m"


# -- requests ----------------------------------------------------------------------------------

MAX_LEN = 256


@pytest.fixture(scope="module")
def llm():
    return LLM(model="dummy:tiny", kv_cache_memory="16MiB", show_progress=False, max_model_len=MAX_LEN)


def _gen_error(llm, prompt, params=None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-added
    return ei.value


def test_empty_prompt(llm):
    e = _gen_error(llm, {"prompt_token_ids": []})
    assert e.field == "prompt" and "empty" in str(e)


@pytest.mark.parametrize("n", [MAX_LEN, MAX_LEN + 44])
def test_prompt_longer_than_max_model_len(llm, n):
    e = _gen_error(llm, {"prompt_token_ids": [1] * n})
    assert e.field == "prompt"
    msg = str(e)
    assert str(n) in msg and str(MAX_LEN) in msg and str(MAX_LEN - 1) in msg


def test_prompt_plus_max_tokens_too_long(llm):
    e = _gen_error(llm, {"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=16))
    assert e.field == "max_tokens"
    msg = str(e)
    for part in ("250", "16", "266", str(MAX_LEN), "<= 6"):
        assert part in msg, (part, msg)
    # The largest allowed max_tokens is accepted.
    out = llm.generate({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("bad", [512, 10**6, -1, 2.0])
def test_token_id_out_of_vocab(llm, bad):
    e = _gen_error(llm, {"prompt_token_ids": [1, 2, bad, 3]})
    assert e.field == "prompt" and "[0, 512)" in str(e)


def test_text_prompt_without_tokenizer(llm):
    e = _gen_error(llm, "hello")
    assert e.field == "prompt" and "prompt_token_ids" in str(e)


def test_lone_surrogate_in_a_text_prompt(tokenizer):
    """JSON can carry "\\ud800"; the tokenizer fails on it (a TypeError deep inside), so the text
    is refused first, naming the field."""
    from kvserve.tokenizer import check_text
    with pytest.raises(TypeError):
        tokenizer.encode("a\ud800b")
    with pytest.raises(InvalidRequestError) as ei:
        check_text("a\ud800b", "prompt")
    assert ei.value.field == "prompt" and "Unicode" in str(ei.value) and "character 1" in str(ei.value)
    assert check_text("é😀\x00", "prompt") == "é😀\x00"


def test_bad_prompt_type_in_engine(llm):
    with pytest.raises(InvalidRequestError) as ei:
        llm.engine.add_request("typed", 3.5)
    assert ei.value.field == "prompt" and "float" in str(ei.value)


def test_one_bad_prompt_rejects_the_whole_batch(llm):
    good = {"prompt_token_ids": [1, 2, 3]}
    e = _gen_error(llm, [good, {"prompt_token_ids": [1, 9999]}, good])
    assert e.field == "prompt"
    assert not llm.engine.scheduler.groups and not llm.engine.output_processor.groups


def test_request_longer_than_kv_pool():
    small = LLM(model="dummy:tiny", kv_cache_memory="64KiB", show_progress=False, max_model_len=1024)
    blocks, bs = small.engine.num_kv_blocks, small.engine.block_size
    assert blocks * bs < 1000
    e = _gen_error(small, {"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=1000))
    assert e.field == "max_tokens" and str(blocks) in str(e) and "KV" in str(e)


def test_every_accepted_request_finishes():
    """A request that validation accepts must be run: here the prompt needs every block of the
    pool but one. Validation checks the total against the pool size; admission also keeps the
    watermark free, so such a request may never be admitted and LLM.generate would spin forever."""
    llm = LLM(model="dummy:tiny", block_size=1, kv_cache_memory=str(200 * 512), show_progress=False)
    e = llm.engine
    n = e.num_kv_blocks
    assert n >= 100 and e.scheduler.watermark_blocks >= 1
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    try:
        e.add_request("big", {"prompt_token_ids": [5] * (n - 1)}, params)
    except InvalidRequestError:
        return  # rejecting it up front is fine too
    for _ in range(50):
        if any(o.finished for o in e.step()):
            break
    assert not e.has_unfinished_requests(), (
        f"accepted request never scheduled: pool {n} blocks, watermark {e.scheduler.watermark_blocks}, "
        f"waiting={len(e.scheduler.waiting)} running={len(e.scheduler.running)}")


# -- a bad request never disturbs the others ---------------------------------------------------

GOOD = [
    ("a", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    ("b", [7, 3, 9, 11] * 5, SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)),
    ("c", [100, 200, 300], SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True)),
]


def _run_to_end(engine, finished: dict) -> None:
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    raise AssertionError("engine did not finish")


def _summary(outs: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason) for c in o.outputs] for rid, o in outs.items()}


def test_bad_request_does_not_disturb_running_ones():
    fresh = LLM(model="dummy:tiny", kv_cache_memory="16MiB", show_progress=False, max_model_len=MAX_LEN)
    ref: dict = {}
    for rid, prompt, sp in GOOD:
        fresh.engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    _run_to_end(fresh.engine, ref)
    assert set(ref) == {"a", "b", "c"}

    llm = LLM(model="dummy:tiny", kv_cache_memory="16MiB", show_progress=False, max_model_len=MAX_LEN)
    e = llm.engine
    got: dict = {}
    for rid, prompt, sp in GOOD:
        e.add_request(rid, {"prompt_token_ids": prompt}, sp)
    for _ in range(2):
        for o in e.step():
            if o.finished:
                got[o.request_id] = o
    used_before = e.kv.pool.num_used_blocks
    n_groups = len(e.scheduler.groups)
    bad = [
        ("bad1", {"prompt_token_ids": [1, 512]}, None, "prompt"),
        ("bad2", {"prompt_token_ids": []}, None, "prompt"),
        ("bad3", {"prompt_token_ids": [1] * MAX_LEN}, None, "prompt"),
        ("bad4", {"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100), "max_tokens"),
        ("a", {"prompt_token_ids": [1, 2, 3]}, None, "request_id"),  # the id of a running request
        ("bad5", "text without a tokenizer", None, "prompt"),
    ]
    for rid, prompt, sp, field in bad:
        with pytest.raises(InvalidRequestError) as ei:
            e.add_request(rid, prompt, sp)
        assert ei.value.field == field, rid
        assert e.kv.pool.num_used_blocks == used_before
        assert len(e.scheduler.groups) == n_groups
        e.check_invariants()
    _run_to_end(e, got)
    assert _summary(got) == _summary(ref)
    assert e.kv.pool.num_used_blocks == 0
    assert not e.scheduler.groups and not e.output_processor.groups
    e.check_invariants()
    # A rejected id is free for later use.
    e.add_request("bad1", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, temperature=0))
    _run_to_end(e, got)
    assert len(got["bad1"].outputs[0].token_ids) == 2
    assert e.kv.pool.num_used_blocks == 0
    e.check_invariants()
