"""The CPU's compiled model (``KernelConfig.cpu_compile``, ``kvserve/engine/cpu_compile.py``):
greedy tokens equal to transformers' on a random small Llama whose projections lie on an int8
grid (kvserve loads them as int8, transformers as the float values), float32, one-token steps (a
1-token prompt, one sequence decoding) taking the compiled graph and larger steps (prompts,
batches) the eager model, in one engine; the model compiled as one graph; int4-packed weights in
bfloat16 against the eager engine; two compiled engines of one model class, other weights, each
keep to their own; a float model, or a compiler that fails, leaves an eager engine that says
why; the default compiles where it applies and quietly runs eagerly elsewhere; bad settings
refused."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from kvserve import LLM, SamplingParams
from kvserve.config import KernelConfig
from kvserve.engine import cpu_compile
from kvserve.errors import ConfigError
from tests.conftest import hf_greedy
from tests.test_kv_eviction import make_llama

N_NEW = 12


def prompts_of(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.slow  # each engine compiles its model (seconds)
def _on_int8_grid(model, path: str) -> None:
    """Round each projection's rows to 255 steps of their own absolute maximum (the grid of
    per-channel int8, which then holds them exactly) and save the model at ``path``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                step = p.abs().amax(1, keepdim=True) / 127
                p.copy_((p / step).round() * step)
    model.save_pretrained(path, safe_serialization=True)


def test_compiled_model_matches_transformers(tmp_path):
    model, _ = make_llama(tmp_path)
    path = str(tmp_path / "int8_grid")
    _on_int8_grid(model, path)
    counters.clear()
    llm = LLM(path, dtype="float32", quantization="int8", kv_cache_memory="8MiB", block_size=4, show_progress=False,
              kernel=KernelConfig(cpu_compile=True))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # the whole model, one graph
    compiled = llm.engine.runner.compiled
    assert compiled is not None and compiled.calls == 0
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    prompts = prompts_of((1, 16, 17, 40))
    want = [hf_greedy(model, p, N_NEW, eos_token_id=None) for p in prompts]
    for i, steps in ((0, N_NEW), (3, N_NEW - 1)):  # alone: one-token steps compiled, a prompt's eager
        before = compiled.calls
        out = llm.generate([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want[i]
        assert compiled.calls - before == steps
    before = compiled.calls
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o, w in zip(prompts, outs, want, strict=True):
        assert o.outputs[0].token_ids == w, f"prompt of {len(p)} tokens"
    assert compiled.calls == before  # a batch's steps: eager
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used_blocks == 0


@pytest.mark.slow
def test_compiled_int4_bfloat16_matches_eager():
    """The fast CPU path: bfloat16 activations, int4 weights packed for PyTorch's CPU kernel."""
    kw = dict(dtype="bfloat16", quantization="int4", quantization_group_size=32, kv_cache_memory="16MiB",
              show_progress=False)
    eager = LLM("dummy:tiny", **kw)
    counters.clear()
    fast = LLM("dummy:tiny", kernel=KernelConfig(cpu_compile=True), **kw)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in prompts_of((3, 9, 30))]
    got = [fast.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time: compiled
    want = [eager.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert fast.engine.runner.compiled.calls == 3 * (N_NEW - 1)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw, t in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, w.outputs[0].token_ids, strict=True):
            # inductor rounds fused bfloat16 ops once where eager rounds after each
            assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=0.05)


def test_compiled_fp8_traces_its_support_check_as_a_constant(recwarn):
    """An fp8 engine's compiled step takes ``_scaled_mm``'s CPU support as a constant: one graph,
    no break, no warning about a cached function traced; its tokens equal the eager engine's."""
    kw = dict(quantization="fp8", kv_cache_memory="16MiB", show_progress=False)
    eager = LLM("dummy:tiny", kernel=KernelConfig(cpu_compile=False), **kw)
    counters.clear()
    fast = LLM("dummy:tiny", kernel=KernelConfig(cpu_compile=True), **kw)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert not [w for w in recwarn if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in recwarn]
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    p = {"prompt_token_ids": prompts_of((7,))[0]}
    assert fast.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == \
        eager.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
    assert fast.engine.runner.compiled.calls == N_NEW - 1


@pytest.mark.slow
def test_compiled_engines_of_one_model_class_keep_to_their_own_weights():
    """Dynamo's guards on the model's modules are skipped (``cpu_compile.CompiledDecode``): each
    engine compiles a code object of its own, so two engines of one model class with other
    weights, decoding in turns in one process, each decode as their eager twins do."""
    kw = dict(quantization="int8", kv_cache_memory="16MiB", show_progress=False)
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of((1, 5))]
    compiled = [LLM("dummy:tiny", seed=s, kernel=KernelConfig(cpu_compile=True), **kw) for s in (0, 1)]
    assert all(e.engine.runner.compiled is not None for e in compiled)
    got = {s: [] for s in (0, 1)}
    for p in prompts:  # in turns, one request at a time: every decode step compiled
        for s in (0, 1):
            got[s].append(compiled[s].generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
    for s in (0, 1):
        eager = LLM("dummy:tiny", seed=s, **kw)
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        assert got[s] == want, f"seed {s}"
        # every decode step, and the 1-token prompt's own step
        assert compiled[s].engine.runner.compiled.calls == len(prompts) * (N_NEW - 1) + 1
    assert got[0] != got[1]  # the weights differ, and so do the tokens


def test_a_float_model_no_compiler_or_a_failing_one_leaves_an_eager_engine(monkeypatch, capsys):
    # Float projections run faster packed for oneDNN, which a graph cannot hold: not compiled.
    llm = LLM("dummy:tiny", dtype="float32", kv_cache_memory="16MiB", kernel=KernelConfig(cpu_compile=True))
    assert llm.engine.runner.compiled is None
    assert "running eagerly: the projections (layers.0.self_attn.qkv_proj, ...) are float weights" in \
        capsys.readouterr().out
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.packed is not None

    # No compiler, or a Python torch.compile does not take: found out before the model is traced
    # (which would take seconds to fail).
    with monkeypatch.context() as m, torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        m.setattr(cpu_compile, "CompiledDecode", None)  # (tracing would call it)
        llm = LLM("dummy:tiny", quantization="int8", kv_cache_memory="16MiB", kernel=KernelConfig(cpu_compile=True))
    assert llm.engine.runner.compiled is None
    assert "running eagerly: torch.compile cannot run here (InvalidCxxCompiler" in capsys.readouterr().out

    def unsupported():
        raise RuntimeError("Python 3.99+ not yet supported for torch.compile")
    with monkeypatch.context() as m:  # (as torch.compile says on a Python newer than it knows)
        m.setattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", unsupported)
        m.setattr(cpu_compile, "CompiledDecode", None)
        llm = LLM("dummy:tiny", quantization="int8", kv_cache_memory="16MiB", kernel=KernelConfig(cpu_compile=True))
    assert llm.engine.runner.compiled is None
    assert "torch.compile cannot run here (RuntimeError: Python 3.99+" in capsys.readouterr().out

    def fail(runner, compiled, rows):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(cpu_compile, "_warm", fail)
    llm = LLM("dummy:tiny", quantization="int8", kv_cache_memory="16MiB", kernel=KernelConfig(cpu_compile=True))
    assert llm.engine.runner.compiled is None
    assert "running eagerly: compiling the model failed (RuntimeError: no C++ compiler)" in capsys.readouterr().out
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.slow
def test_default_compiles_where_it_applies_and_runs_eagerly_elsewhere(monkeypatch, capsys):
    """``cpu_compile`` None (the default): a quantized model compiles; enforce_eager,
    ``KVSERVE_CPU_COMPILE=0``, a float model and settings the compiled model cannot work with
    (sleep mode) start eagerly, without a word and without an error."""
    monkeypatch.delenv("KVSERVE_CPU_COMPILE", raising=False)
    kw = dict(quantization="int8", kv_cache_memory="16MiB", show_progress=True)
    assert KernelConfig().cpu_compile is None
    llm = LLM("dummy:tiny", **kw)
    assert llm.engine.runner.compiled is not None
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": prompts_of((4,))[0]}]
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.runner.compiled.calls == N_NEW - 1
    eager = LLM("dummy:tiny", enforce_eager=True, **kw)
    assert eager.engine.runner.compiled is None
    assert eager.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == got
    monkeypatch.setenv("KVSERVE_CPU_COMPILE", "0")
    assert LLM("dummy:tiny", **kw).engine.runner.compiled is None
    monkeypatch.setenv("KVSERVE_CPU_COMPILE", "1")
    assert LLM("dummy:tiny", dtype="float32", kv_cache_memory="16MiB").engine.runner.compiled is None
    assert LLM("dummy:tiny", enable_sleep_mode=True, **kw).engine.runner.compiled is None
    # every decode step verifies a draft: a graph of one token would never run
    spec = {"method": "layer_skip", "draft_layers": 1, "num_speculative_tokens": 2}
    assert LLM("dummy:tiny", speculative_config=spec, **kw).engine.runner.compiled is None
    assert "running eagerly" not in capsys.readouterr().out
    monkeypatch.setenv("KVSERVE_CPU_COMPILE", "yes")
    with pytest.raises(ConfigError, match="KVSERVE_CPU_COMPILE.*must be 0 or 1; got 'yes'"):
        LLM("dummy:tiny", **kw)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="cpu_compile.*must be True, False or None, got 'yes'"):
        KernelConfig(cpu_compile="yes")
    with pytest.raises(ConfigError, match="cpu_compile.*enable_sleep_mode"):
        LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, enable_sleep_mode=True,
            kernel=KernelConfig(cpu_compile=True))
