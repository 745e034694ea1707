"""A dropped engine gives its memory back although start-up froze the heap (``gc.freeze``):
frozen objects in a reference cycle are never collected unless the heap is unfrozen first."""
from __future__ import annotations

import gc
import weakref

import pytest

from kvserve import LLM
from kvserve.errors import ConfigError


def _engine_in_a_cycle() -> tuple[LLM, weakref.ref, weakref.ref]:
    llm = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB")
    eng = llm.engine
    # Captured CUDA graphs, progress callbacks and bound methods tie a GPU engine's parts into
    # cycles; the same shape here, on objects that start-up froze.
    eng.runner.owner = eng
    assert gc.get_freeze_count() > 0
    return llm, weakref.ref(eng), weakref.ref(eng.runner.kv_cache)


def test_dropped_llm_is_collected():
    llm, eng, kv = _engine_in_a_cycle()
    del llm
    gc.collect()
    assert eng() is None and kv() is None


def test_next_engine_collects_a_dropped_one():
    llm, eng, kv = _engine_in_a_cycle()
    del llm
    gc.freeze()  # frozen again before any collection ran: the dropped engine is frozen garbage
    assert eng() is not None
    other = LLM("dummy:tiny", show_progress=False, kv_cache_memory="16MiB")
    assert eng() is None and kv() is None
    assert other.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def test_a_failed_start_leaves_the_next_engine_working():
    """A start that fails (a bad option) while the tokenizer's thread still imports transformers
    waits for it: the next engine in the process must not find that import half made."""
    for bad, option in ((dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
                        (dict(kv_cache_dtype="int4", kv_group_size=24), "kv_group_size"),
                        (dict(kv_cache_dtype="int2", preemption_mode="swap"), "preemption_mode")):
        with pytest.raises(ConfigError, match=option):
            LLM(show_progress=False, kv_cache_memory="64MiB", **bad)
    llm = LLM(show_progress=False, kv_cache_memory="64MiB")  # the default model: its tokenizer too
    assert llm.engine.tokenizer is not None
