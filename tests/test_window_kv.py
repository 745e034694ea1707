"""Sliding-window KV freeing (``window_kv="free"``, ``engine/kv_groups.py``) on random small Gemma 3
models: greedy output token-identical to the same engine keeping every block (``"keep"``) and to
transformers, with prompts several windows long in one batch, chunked prefill, prefix-cache hits
and preemption; fewer blocks held; nothing leaked."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_groups import plan_groups
from kvserve.errors import ConfigError
from tests.conftest import hf_greedy

N_NEW = 10
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def make_gemma3(tmp_path, layer_types: list[str], window: int = 16):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                           sliding_window=window, query_pre_attn_scalar=32, layer_types=layer_types,
                           rope_parameters={LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
                                            GLOBAL: {"rope_type": "default", "rope_theta": 1e6}},
                           eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-zero, far from uniform logits (no near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0.0, 0.1 if p.dim() > 1 else 0.3)
    path = tmp_path / "gemma3"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def prompts_of(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs, stepping the engine by hand: and the most KV bytes the pool held."""
    eng = llm.engine
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    out: dict[str, list[int]] = {}
    kv = eng.runner.kv_cache
    page_bytes = kv.nbytes // kv.num_blocks
    peak = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        peak = max(peak, eng.kv.pool.num_used_blocks * page_bytes)
        eng.check_invariants()
    assert eng.kv.pool.num_used_blocks == 0
    return [out[f"r{i}"] for i in range(len(prompts))], peak


# 6 layers, 5 local to 1 global (Gemma 3's ratio): six groups of one layer; 8 layers, 6 local and
# 2 global: four groups of two; every layer local (Mistral's pattern): one local group. ``small``:
# a pool that preempts with freeing on (admission keeping no room for decoding).
@pytest.mark.parametrize("layer_types,num_groups,small", [
    ([LOCAL] * 5 + [GLOBAL], 6, "128KiB"), ([LOCAL] * 3, 1, "64KiB"),
    pytest.param([LOCAL, LOCAL, GLOBAL, LOCAL] * 2, 4, "192KiB", marks=pytest.mark.slow)])
def test_freeing_changes_no_output(tmp_path, layer_types, num_groups, small):
    model, path = make_gemma3(tmp_path, layer_types)
    prompts = prompts_of((5, 40, 70, 130))
    outs, peaks = {}, {}
    for mode, mem in (("free", "1MiB"), ("keep", "1MiB"), ("free", small)):
        # A small budget chunks the prompts.
        llm = LLM(path, show_progress=False, kv_cache_memory=mem, block_size=8, max_num_batched_tokens=32,
                  window_kv=mode, decode_reserve=0 if mem == small else None)
        assert llm.engine.kv_plan.groups.num_groups == (num_groups if mode == "free" else 1)
        got, peak = run(llm, prompts)
        if mem == small:
            assert llm.engine.scheduler.num_preemptions > 0
        else:
            again, _ = run(llm, prompts)
            assert llm.engine.kv.prefix_hits > 0 and again == got
            peaks[mode] = peak
        outs.setdefault(mode, got)
        assert got == outs[mode]
    assert outs["free"] == outs["keep"]
    assert peaks["free"] < peaks["keep"]
    # The longest prompt, eight windows long, against the reference.
    assert outs["free"][-1] == hf_greedy(model, prompts[-1], N_NEW, eos_token_id=None)


def test_long_decode_holds_the_window_only(tmp_path):
    """A request decoding far past the window: its local group holds a window's blocks, whatever
    its length; the pool's bytes per token approach the global layers' share."""
    _, path = make_gemma3(tmp_path, [LOCAL] * 5 + [GLOBAL])
    llm = LLM(path, show_progress=False, kv_cache_memory="8MiB", block_size=8, window_kv="free")
    eng = llm.engine
    eng.add_request("r", {"prompt_token_ids": prompts_of((20,))[0]},
                    SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        if eng.has_unfinished_requests():
            req = eng.scheduler.running[0]
            tables = eng.kv.tables_of(req)
            held.append([sum(b >= 0 for b in t) for t in tables])
    groups = eng.kv_plan.groups
    for g, w in enumerate(groups.windows):
        most = max(h[g] for h in held)
        if w is None:
            assert most >= 120 // 8
        else:  # the window's keys span at most ceil(15 / 8) + 1 blocks, plus the block being filled
            assert most <= 3, (g, most)
    assert eng.kv.pool.num_used_blocks == 0


@pytest.mark.unit
def test_groups_of_gemma3_shapes():
    g270 = plan_groups(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)), 18)
    assert (g270.num_groups, g270.page_layers) == (6, 3) and g270.windows == (None,) + (512,) * 5
    assert [g270.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    g27 = plan_groups(tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62)), 62)
    assert (g27.num_groups, g27.page_layers) == (31, 2)
    for g in (g270, g27):  # each page slot of each group is one layer
        assert len({(lg, s) for lg, s in zip(g.layer_group, g.layer_slot)}) == len(g.layer_group)
        assert max(g.layer_slot) == g.page_layers - 1
    assert plan_groups((512,) * 4, 4).windows == (512,)
    assert plan_groups((512, None), 2, free_windows=False).windows == (None,)


def test_swap_and_tiers_refused_with_freeing(tmp_path):
    _, path = make_gemma3(tmp_path, [LOCAL, GLOBAL])
    with pytest.raises(ConfigError, match="preemption_mode"):
        LLM(path, show_progress=False, kv_cache_memory="1MiB", preemption_mode="swap")
    with pytest.raises(ConfigError, match="cpu_kv_memory"):
        LLM(path, show_progress=False, kv_cache_memory="1MiB", cpu_kv_memory="1MiB")
    with pytest.raises(ConfigError, match="window_kv"):
        LLM(path, show_progress=False, kv_cache_memory="1MiB", window_kv="drop")
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", preemption_mode="swap", window_kv="keep")
    assert llm.engine.kv_plan.groups.num_groups == 1
