"""Sleep mode: sleep/wake at both levels gives the same tokens and log-probs and the same KV-pool
accounting; 20 cycles leave no tensor or block behind; every fault (double sleep, wake while
awake, requests in flight, sleep mode off, bad arguments, a failed wake and its retry)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from kvserve.errors import ConfigError, EngineBusyError, InvalidRequestError, WakeUpError
from kvserve.llm import LLM
from kvserve.models import snapshot
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [400, 2, 2, 5, 17, 300, 41]]  # the first fills two 16-token blocks


def _outputs(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _tiny(model: str = "dummy:tiny", **kw) -> LLM:
    return LLM(model, kv_cache_memory="16MiB", show_progress=False, enable_sleep_mode=True, **kw)


def _weights_gone(llm: LLM) -> bool:
    return all(p.numel() == 0 for p in llm.engine.runner.model.parameters())


@pytest.fixture(scope="module")
def smol():
    return LLM(kv_cache_memory="64MiB", show_progress=False, enable_sleep_mode=True)


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
def test_default_model_same_output_and_pool_after_wake(smol, level):
    """Level 2 reloads from the GGUF file. The prefix cache held these prompts before the sleep:
    a block still marked cached after it would serve zeros and change the output. (The reference
    runs without prefix hits, as the run after the wake does: a prefill over cached blocks rounds
    differently in the last bits.)"""
    prompts = [{"prompt_token_ids": smol.apply_chat_template([{"role": "user", "content": "Hi! Who are you?"}])},
               "Paris is the capital of"]
    smol.engine.kv.pool.reset_prefix_cache()
    ref = _outputs(smol, prompts)
    pool = smol.engine.kv.pool
    assert pool.num_cached_blocks > 0 and pool.num_free_blocks == pool.num_blocks
    smol.sleep(level)
    assert smol.is_sleeping() and smol.engine.sleep_level == level
    assert _weights_gone(smol) and smol.engine.runner.kv_cache is None
    smol.wake_up()
    assert not smol.is_sleeping() and smol.engine.sleep_level == 0
    assert pool.num_free_blocks == pool.num_blocks and pool.num_cached_blocks == 0
    pool.check_invariants()
    assert _outputs(smol, prompts) == ref


def test_a_request_wakes_the_engine():
    llm = _tiny()
    ref = _outputs(llm)
    for level in (1, 2):
        llm.sleep(level)
        assert _outputs(llm) == ref and not llm.is_sleeping()
        llm.sleep(level)
        assert llm.embed([5, 6, 7]) == llm.embed([5, 6, 7]) and not llm.is_sleeping()


def _census() -> tuple[int, int]:
    """Live tensors and the bytes of their distinct storages."""
    gc.collect()
    storages = {}
    n = 0
    for o in gc.get_objects():
        if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
            n += 1
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return n, sum(storages.values())


def test_twenty_cycles_leak_nothing():
    llm = _tiny()
    ref = _outputs(llm)
    pool = llm.engine.kv.pool
    llm.sleep(1)  # the first level-1 sleep makes the host copy that later ones reuse
    llm.wake_up()
    _outputs(llm)
    before = _census()
    for i in range(20):
        llm.sleep(1 + i % 2)
        llm.wake_up()
        if i % 5 < 2:  # both levels, now and then
            assert _outputs(llm) == ref
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_invariants()
        llm.engine.check_invariants()
    # The last cycle was level 2 (no host copy); sleep at level 1 once more to compare like with like.
    llm.sleep(1)
    llm.wake_up()
    _outputs(llm)
    assert _census() == before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_what_the_cpu_paths_derived(level):
    """A CPU engine's int4 layers keep their scales converted to the activations' dtype, and
    RoPE the step's cos/sin: asleep, the model holds neither; awake, the same tokens."""
    from kvserve.layers.quant_linear import QuantLinear
    from kvserve.layers.rotary import RotaryEmbedding
    llm = _tiny(quantization="int4", quantization_group_size=32)
    before = _outputs(llm)
    mods = list(llm.engine.runner.model.modules())
    assert any(isinstance(m, QuantLinear) and m._cast is not None for m in mods)
    assert any(isinstance(m, RotaryEmbedding) and m._step is not None for m in mods)
    llm.sleep(level)
    assert not any(isinstance(m, QuantLinear) and m._cast is not None for m in mods)
    assert not any(isinstance(m, RotaryEmbedding) and m._step is not None for m in mods)
    llm.wake_up()
    assert _outputs(llm) == before


def test_double_sleep_keeps_the_first_level():
    llm = _tiny()
    ref = _outputs(llm)
    llm.sleep(1)
    llm.sleep(2)  # no-op: the host copy stays, so waking is still a copy
    llm.sleep(1)
    assert llm.engine.sleep_level == 1 and llm.engine.runner.sleep_mode._host is not None
    llm.wake_up()
    assert _outputs(llm) == ref


def test_wake_while_awake_changes_nothing():
    llm = _tiny()
    ref = _outputs(llm)
    ptrs = [p.data_ptr() for p in llm.engine.runner.model.parameters()]
    kv = llm.engine.runner.kv_cache
    llm.wake_up()
    llm.wake_up(["kv_cache"])
    assert [p.data_ptr() for p in llm.engine.runner.model.parameters()] == ptrs
    assert llm.engine.runner.kv_cache is kv and not llm.is_sleeping()
    assert _outputs(llm) == ref


def test_wake_part_by_part():
    llm = _tiny()
    ref = _outputs(llm)
    llm.sleep(1)
    llm.wake_up(["kv_cache"])
    assert llm.is_sleeping() and _weights_gone(llm) and llm.engine.runner.kv_cache is not None
    llm.wake_up(["weights"])
    assert not llm.is_sleeping()
    assert _outputs(llm) == ref


def test_sleep_with_requests_in_flight_is_refused():
    llm = _tiny()
    eng = llm.engine
    eng.add_request("r1", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(EngineBusyError, match="1 requests in flight"):
        llm.sleep(1)
    assert not llm.is_sleeping() and not _weights_gone(llm)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finished] == ["r1"] and len(finished[0].outputs[0].token_ids) == 10
    llm.sleep(1)
    assert llm.is_sleeping()


def test_sleep_mode_off_is_a_clear_error():
    llm = LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False)
    for call in (lambda: llm.sleep(1), lambda: llm.wake_up()):
        with pytest.raises(ConfigError, match="enable_sleep_mode.*enable_sleep_mode=True"):
            call()
    assert not llm.is_sleeping()
    with pytest.raises(ConfigError, match="enable_sleep_mode: must be True or False"):
        LLM("dummy:tiny", kv_cache_memory="16MiB", enable_sleep_mode="yes")


@pytest.mark.parametrize("level", [0, 3, -1, True, "1", 1.0, 2**63, float("nan"), None])
def test_bad_levels(level):
    llm = _tiny()
    with pytest.raises(InvalidRequestError) as e:
        llm.sleep(level)
    assert e.value.field == "level" and "must be 1 or 2" in e.value.message
    assert not llm.is_sleeping()


@pytest.mark.parametrize("tags", [[], ["weights", "gpu"], "weights", [None], {"weights": 1}, ["é" * 10_000]])
def test_bad_tags(tags):
    llm = _tiny()
    llm.sleep(1)
    with pytest.raises(InvalidRequestError) as e:
        llm.wake_up(tags)
    assert e.value.field == "tags" and "weights, kv_cache" in e.value.message and len(str(e.value)) < 300
    assert llm.is_sleeping()


def test_failed_wake_sleeps_on_and_a_retry_works(tmp_path):
    """Level 2 from a snapshot whose shard goes missing, then changes: each wake fails, the
    engine sleeps on with its memory freed; with the file back, a retry serves the same tokens."""
    out = str(tmp_path / "snap")
    snapshot.write(_tiny().engine, out)
    llm = _tiny(out)
    ref = _outputs(llm)
    shard = os.path.join(out, "model-00000.safetensors")
    llm.sleep(2)
    os.rename(shard, shard + ".away")
    with pytest.raises(WakeUpError, match="missing; the snapshot is incomplete.*retry wake_up"):
        llm.wake_up()
    assert llm.is_sleeping() and _weights_gone(llm) and llm.engine.runner.kv_cache is None
    with pytest.raises(WakeUpError):  # a request wakes the engine: it fails the same way, nothing is left queued
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    os.rename(shard + ".away", shard)
    good = open(shard, "rb").read()
    with open(shard, "r+b") as f:
        f.seek(len(good) - 3)
        f.write(bytes([good[-3] ^ 1]))
    with pytest.raises(WakeUpError, match="checksum does not match"):
        llm.wake_up()
    assert llm.is_sleeping() and _weights_gone(llm)
    open(shard, "wb").write(good)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _outputs(llm) == ref


def test_kv_pool_that_no_longer_fits_fails_the_wake_then_retries(monkeypatch):
    """The KV pool cannot be allocated (on a GPU: another process took the memory while asleep)."""
    llm = _tiny()
    ref = _outputs(llm)
    llm.sleep(1)
    runner = llm.engine.runner
    real = type(runner).restore_kv_cache

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    monkeypatch.setattr(type(runner), "restore_kv_cache", oom)
    with pytest.raises(WakeUpError, match="OutOfMemoryError"):
        llm.wake_up()
    assert llm.is_sleeping() and not _weights_gone(llm)  # the weights came back; only the KV pool sleeps
    monkeypatch.setattr(type(runner), "restore_kv_cache", real)
    assert _outputs(llm) == ref and not llm.is_sleeping()


def test_level_1_hands_the_prefix_cache_to_the_kv_tiers():
    llm = _tiny(cpu_kv_memory="8MiB")
    ref = _outputs(llm)
    llm.sleep(1)
    assert llm.engine.store.snapshot()["cpu"]["used_bytes"] > 0
    llm.wake_up()
    assert _outputs(llm) == ref
    st = llm.engine.store.load_stats
    assert st.tokens_loaded["cpu"] + st.tokens_recomputed_by_choice >= 32  # two blocks found in the tier
    llm.sleep(1)
    llm.shutdown()  # what runs at exit: the tiers are flushed with no KV pool on the device
