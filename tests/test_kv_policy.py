"""``kv_policy="auto"`` (``kvserve/engine/kv_policy.py``): the KV format follows the pool. On
dummy:tiny (512 bytes of fp32 KV per token) with max_model_len 256 the target is 8 sequences of
256 tokens: a pool that holds them keeps the model dtype, a smaller one goes to int8, a much
smaller one to int4 and says it is short; what the user fixed stays; the engine runs on what
was chosen."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError


def auto(memory: str, **kw) -> LLM:
    return LLM("dummy:tiny", kv_cache_memory=memory, max_model_len=256, show_progress=False,
               kv_policy="auto", **kw)


@pytest.mark.parametrize("memory,dtype,short", [("4MiB", "auto", False), ("512KiB", "int8", False),
                                                ("64KiB", "int4", True)])
def test_format_follows_the_pool(memory, dtype, short):
    llm = auto(memory)
    choice = llm.engine.kv_policy
    assert choice.kv_cache_dtype == dtype == llm.config.cache.kv_cache_dtype
    if dtype != "auto":
        assert llm.engine.runner.kv_format.name == dtype
    assert (choice.fits_sequences < choice.target_sequences) == short
    assert ("short of the target" in choice.reason) == short
    # the pool really holds what the choice counted
    blocks = llm.engine.kv.pool.num_blocks * llm.config.cache.block_size
    assert blocks >= choice.fits_sequences * 256
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3,
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_what_the_user_fixed_stays():
    assert auto("512KiB", kv_cache_dtype="int4").engine.kv_policy.kv_cache_dtype == "int4"
    choice = auto("512KiB", kv_eviction="h2o").engine.kv_policy
    assert choice.kv_cache_dtype == "auto" and "kv_eviction h2o" in choice.reason


def test_windows_are_freed_and_counted():
    llm = LLM("dummy:tiny-gemma3", kv_cache_memory="4MiB", max_model_len=256, show_progress=False,
              kv_policy="auto", window_kv="keep")
    assert llm.config.cache.window_kv == "free" and "sliding-window blocks freed" in llm.engine.kv_policy.reason


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError) as ei:
        LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, kv_policy="fast")
    assert ei.value.option == "kv_policy"
