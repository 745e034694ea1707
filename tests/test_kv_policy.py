"""``kv_policy="auto"`` (``kvserve/engine/kv_policy.py``): the KV format follows the pool. On
dummy:tiny (512 bytes of fp32 KV per token) the target is 8 sequences of max_model_len tokens: a
pool that holds them keeps the model dtype, a smaller one goes to int8, a much smaller one to int4
(for long sequences; for short ones int4's key residual, a block per running sequence, leaves it
no more sequences than int8) and says it is short; short everywhere, the format holding the most
wins (on a sliding-window model that can be int8); what the user fixed stays; the engine runs on
what was chosen. ``kv_quality_floor`` bounds the ladder; at "eviction" a pool short of the target
keeps the model dtype and a request that may pass its share of the pool runs under that budget,
exactly as a manual engine given the same budget does."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError


def auto(memory: str, max_len: int = 256, **kw) -> LLM:
    return LLM("dummy:tiny", kv_cache_memory=memory, max_model_len=max_len, show_progress=False,
               kv_policy="auto", **kw)


@pytest.mark.parametrize("memory,max_len,dtype,short", [
    ("4MiB", 256, "auto", False), ("512KiB", 256, "int8", False), ("128KiB", 256, "int8", True),
    ("512KiB", 1024, "int4", True)])
def test_format_follows_the_pool(memory, max_len, dtype, short):
    llm = auto(memory, max_len)
    choice = llm.engine.kv_policy
    assert choice.kv_cache_dtype == dtype == llm.config.cache.kv_cache_dtype
    if dtype != "auto":
        assert llm.engine.runner.kv_format.name == dtype
    assert (choice.fits_sequences < choice.target_sequences) == short
    assert ("short of the target" in choice.reason) == short
    # the pool really holds what the choice counted
    blocks = llm.engine.kv.pool.num_blocks * llm.config.cache.block_size
    assert blocks >= choice.fits_sequences * max_len
    assert choice.fits_sequences <= llm.engine.config.scheduler.max_num_seqs
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


def test_sequences_counted_are_ones_the_scheduler_runs():
    """int4's full-precision key residual takes a row per running sequence; in a small pool it
    lowers max_num_seqs below what the blocks hold, and the count is the lower of the two."""
    llm = LLM("dummy:tiny", kv_cache_memory="64KiB", kv_cache_dtype="int4", max_model_len=64, show_progress=False)
    assert llm.engine.config.scheduler.max_num_seqs == 1
    blocks = llm.engine.kv.pool.num_blocks * llm.config.cache.block_size
    assert blocks >= 2 * 64  # the blocks alone would hold two
    assert llm.engine.kv_policy.fits_sequences == 1


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError) as ei:
        LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, kv_policy="fast")
    assert ei.value.option == "kv_policy"


def test_short_everywhere_takes_the_format_that_holds_most(tmp_path):
    """Gemma 3's pattern (five local layers to one global), a 16-token window, 1,024 tokens: int8
    frees the local layers' blocks out of the window, int4 (KIVI) keeps every layer's, so in a
    pool short of the target for both, int8 holds more sequences and is the one chosen."""
    from tests.test_window_kv import GLOBAL, LOCAL, make_gemma3
    _, path = make_gemma3(tmp_path, [LOCAL] * 5 + [GLOBAL], window=16)
    llm = LLM(path, kv_cache_memory="192KiB", max_model_len=1024, show_progress=False, kv_policy="auto")
    choice = llm.engine.kv_policy
    assert choice.fits_sequences < choice.target_sequences
    assert choice.kv_cache_dtype == "int8", choice.reason
    for dtype in ("int8", "int4"):  # what each holds, by the engine's own accounting
        manual = LLM(path, kv_cache_memory="192KiB", max_model_len=1024, show_progress=False,
                     kv_cache_dtype=dtype).engine.kv_policy.fits_sequences
        if dtype == "int8":
            assert manual == choice.fits_sequences
        else:
            assert manual < choice.fits_sequences


# -- kv_quality_floor: the lossiest lever auto may use ------------------------------------------
@pytest.mark.parametrize("floor,dtype", [("lossless", "auto"), ("int8", "int8"), ("int4", "int4")])
def test_the_floor_bounds_the_ladder(floor, dtype):
    """The pool where the default ladder goes down to int4 (above): each floor stops where it says."""
    choice = auto("512KiB", 1024, kv_quality_floor=floor).engine.kv_policy
    assert choice.kv_cache_dtype == dtype and choice.quality_floor == floor
    assert choice.share is None and choice.kv_eviction == "none"


LONG = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(40)]}  # 40 tokens, 160 more asked


def test_eviction_floor_gives_a_long_request_its_share():
    """Short of the target in every format: the model dtype, and a request that may pass its share
    of the pool runs under a kv_budget of that share (streaming, the default policy); a short one
    keeps full KV; the caller's SamplingParams are left alone. The long request decodes exactly
    what a manual engine with the same budget decodes."""
    llm = auto("256KiB", kv_quality_floor="eviction")
    choice = llm.engine.kv_policy
    pool_tokens = llm.engine.kv.pool.num_blocks * llm.config.cache.block_size
    assert choice.kv_cache_dtype == "auto" and choice.kv_eviction == "streaming"
    assert choice.fits_sequences < choice.target_sequences
    assert choice.share == pool_tokens // choice.target_sequences and 0 < choice.share < 256
    assert "streaming eviction" in choice.reason and str(choice.share) in choice.reason
    long_params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([LONG, {"prompt_token_ids": [5, 6, 7]}], [long_params, short], use_tqdm=False)
    assert long_params.kv_budget is None
    got = outs[0].metrics.kv_policy
    assert (got.eviction, got.kv_budget) == ("streaming", choice.share) and "share" in got.reason
    assert outs[1].metrics.kv_policy.eviction == "none" and outs[1].metrics.kv_policy.kv_budget is None
    assert len(outs[0].outputs[0].token_ids) == 160
    llm.engine.check_invariants()
    manual = LLM("dummy:tiny", kv_cache_memory="256KiB", max_model_len=256, show_progress=False,
                 kv_eviction="streaming")
    want = manual.generate([LONG], SamplingParams(max_tokens=160, temperature=0, ignore_eos=True,
                                                  kv_budget=choice.share), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_eviction_floor_is_not_used_where_the_target_fits_or_eviction_cannot_run(tmp_path):
    assert auto("4MiB", kv_quality_floor="eviction").engine.kv_policy.share is None
    choice = auto("256KiB", kv_quality_floor="eviction", cpu_kv_memory="1MiB").engine.kv_policy
    assert choice.share is None and choice.kv_eviction == "none"
    assert "eviction cannot run beside KV tiers" in choice.reason
    choice = auto("128KiB", kv_quality_floor="eviction").engine.kv_policy  # 32 tokens a sequence: too few
    assert choice.share is None and "below the smallest kv_budget" in choice.reason
    llm = auto("256KiB", kv_quality_floor="eviction", kv_eviction="h2o")  # the user's policy is the one used
    assert (llm.engine.kv_policy.kv_eviction, llm.config.cache.kv_eviction) == ("h2o", "h2o")
    assert llm.engine.kv_policy.share is not None


def test_a_request_too_long_for_the_pool_at_full_length_runs_on_its_share():
    """LLM.generate checks every request before it enters the engine: the share counts there, so
    a request whose full length the pool cannot hold (600 tokens; the pool holds 512) is run, not
    refused; without the floor it is refused, naming max_tokens."""
    kw = dict(kv_cache_memory="256KiB", max_model_len=2048, show_progress=False, kv_policy="auto")
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    out = LLM("dummy:tiny", kv_quality_floor="eviction", **kw).generate([LONG], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 600 and out.metrics.kv_policy.kv_budget == 64
    with pytest.raises(InvalidRequestError) as ei:
        LLM("dummy:tiny", kv_quality_floor="lossless", **kw).generate([LONG], params, use_tqdm=False)
    assert ei.value.field == "max_tokens"


def test_a_request_of_its_own_budget_keeps_it():
    llm = auto("256KiB", kv_quality_floor="eviction")
    out = llm.generate([LONG], SamplingParams(max_tokens=160, temperature=0, ignore_eos=True, kv_budget=48),
                       use_tqdm=False)[0]
    assert out.metrics.kv_policy.kv_budget == 48 and out.metrics.kv_policy.reason == "the request's kv_budget"


@pytest.mark.parametrize("floor", ["fp8", "", None, 3, "EVICTION"])
def test_bad_quality_floor_names_the_field(floor):
    with pytest.raises(ConfigError) as ei:
        auto("1MiB", kv_quality_floor=floor)
    assert ei.value.option == "kv_quality_floor"


def test_a_quality_floor_without_kv_policy_auto_is_refused():
    with pytest.raises(ConfigError, match="kv_policy 'auto'") as ei:
        LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, kv_quality_floor="eviction")
    assert ei.value.option == "kv_quality_floor"
