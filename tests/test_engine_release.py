"""A dropped engine gives its memory back although start-up froze the heap (``gc.freeze``):
frozen objects in a reference cycle are never collected unless the heap is unfrozen first."""
from __future__ import annotations

import gc
import weakref

from kvserve import LLM


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
