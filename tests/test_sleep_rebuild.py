"""Sleep level 2 without a snapshot: waking rebuilds the weights from the model's own source (a
GGUF file, a Hugging Face directory) as start-up did, quantization included. The same greedy
tokens and log-probs and the same KV-pool accounting after each wake; while asleep no weight,
packed or not, is left on the device; ten cycles leave no tensor behind."""
from __future__ import annotations

import pytest

from kvserve.llm import LLM
from tests.test_bad_input import _tiny_hf_dir
from tests.test_sleep_mode import GREEDY, _census, _outputs


def _all_weights_gone(llm: LLM) -> bool:
    m = llm.engine.runner.model
    return all(t.numel() == 0 for t in [*m.parameters(), *m.buffers()])


def _accounting(llm: LLM) -> tuple:
    pool = llm.engine.kv.pool
    pool.check_invariants()
    return pool.num_blocks, pool.num_free_blocks, llm.engine.runner.kv_cache.data.shape


@pytest.mark.slow
def test_level_2_rebuilds_a_quantized_gguf_model():
    """The default model's GGUF file, quantized to int8 at load: the wake converts and quantizes
    it again (a rebuilt model that differed by one weight would change the log-probs)."""
    llm = LLM(kv_cache_memory="16MiB", show_progress=False, enable_sleep_mode=True, quantization="int8")
    prompts = ["Paris is the capital of", [400, 2, 2, 5, 17, 300, 41]]
    llm.engine.kv.pool.reset_prefix_cache()
    ref, acct = _outputs(llm, prompts), _accounting(llm)
    llm.engine.kv.pool.reset_prefix_cache()  # the run after the wake finds no prefix hits either
    llm.sleep(2)
    assert _all_weights_gone(llm) and llm.engine.runner.sleep_mode._host is None
    llm.wake_up()
    assert _accounting(llm) == acct and llm.engine.kv.pool.num_cached_blocks == 0
    assert _outputs(llm, prompts) == ref


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_ten_level_2_cycles_from_a_hf_directory_leak_nothing(tmp_path, quantization):
    llm = LLM(_tiny_hf_dir(str(tmp_path / "hf")), kv_cache_memory="16MiB", show_progress=False,
              enable_sleep_mode=True, quantization=quantization, tokenizer=None,
              quantization_group_size=32 if quantization else None)
    llm.engine.kv.pool.reset_prefix_cache()
    ref, acct = _outputs(llm), _accounting(llm)
    llm.sleep(2)
    llm.wake_up()
    _outputs(llm)
    before = _census()
    for _ in range(10):
        llm.engine.kv.pool.reset_prefix_cache()
        llm.sleep(2)
        assert _all_weights_gone(llm) and llm.engine.runner.kv_cache is None
        llm.wake_up()
        assert _accounting(llm) == acct
        assert _outputs(llm) == ref
        llm.engine.check_invariants()
    assert _census() == before


def test_level_1_takes_the_packed_weights_off_the_device_too():
    """A quantized layer's packed weights and scales are buffers: they sleep with the rest."""
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, enable_sleep_mode=True,
              quantization="int8")
    ref = _outputs(llm)
    llm.sleep(1)
    assert _all_weights_gone(llm)
    llm.wake_up()
    assert _outputs(llm) == ref
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
