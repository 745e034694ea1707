"""Tensor parallelism on the CPU: two ranks over gloo (rank 0 here, one spawned worker) against
one rank and against transformers on the same random weights."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.calibrate import calibrate
from kvserve.config import EngineConfig, SpeculativeConfig
from kvserve.engine.tp_workers import WorkerDiedError
from kvserve.errors import ConfigError, ModelLoadError
from kvserve.layers.linear import Linear
from kvserve.layers.parallel import check_shape
from kvserve.models import snapshot
from tests.conftest import hf_greedy
from tests.test_parity_qwen import _make

N_NEW = 16
# Chunked prefill (prompts longer than the step's 32 tokens), a shared 24-token prefix (three
# full blocks), and a pool of 24 blocks per rank at TP = 2 that cannot hold every request at
# once (preemption); at TP = 1 the same bytes hold 12 blocks, still one whole request.
# A pool small enough to preempt (admission keeping no room for decoding), prompts chunked.
ENGINE = dict(show_progress=False, device="cpu", kv_cache_memory="72KiB", block_size=8, max_num_batched_tokens=32,
              decode_reserve=0)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 1000, (24,), generator=gen).tolist()
    return [prefix + torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (17, 30, 5, 36, 22)]


def _greedy(llm: LLM, prompts, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, **kw), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Random Qwen2 weights (QKV bias, untied LM head: 8 heads, 2 KV heads) as safetensors."""
    return _make(tmp_path_factory.mktemp("tp"), "qwen2")


@pytest.fixture(scope="module")
def tp2(qwen):
    llm = LLM(qwen[1], tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def test_two_ranks_match_transformers_and_one_rank(qwen, tp2):
    model, path = qwen
    prompts = _prompts()
    got = _greedy(tp2, prompts)
    assert got == [hf_greedy(model, p, N_NEW, eos_token_id=None) for p in prompts]
    one = LLM(path, **ENGINE)
    assert _greedy(one, prompts) == got
    # One rank builds the plain layers, with nothing split and no group.
    rt = one.engine.runner
    assert rt.tp is None and type(rt.model.layers[0].self_attn.o_proj) is Linear
    assert not any(hasattr(p, "tp_shards") for p in rt.model.parameters())
    # The schedule really chunked, shared and preempted, and nothing leaked on rank 0's books.
    e = tp2.engine
    assert e.scheduler.num_preemptions > 0 and e.kv.prefix_hits > 0
    assert e.runner.kv_cache.data.shape[4] == 1  # one of the 2 KV heads per rank
    assert e.kv.pool.num_used_blocks == 0
    e.check_invariants()


def test_two_rank_logits_match_transformers(qwen, tp2):
    model, _ = qwen
    ids = _prompts()[3]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    runner = tp2.engine.runner
    with torch.inference_mode():
        got = runner._logits(runner.hidden_states(ids))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_compressed_kv_per_rank(qwen, tmp_path):
    """int8 KV (a scale per token and head): each rank quantizes its own heads, as one rank does.
    Such an engine writes no snapshot (each rank holds a slice of the weights)."""
    _, path = qwen
    prompts = _prompts()[:3]
    kw = dict(ENGINE, kv_cache_dtype="int8", block_size=16, kv_cache_memory="1MiB")
    one = _greedy(LLM(path, **kw), prompts)
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert _greedy(llm, prompts) == one
        with pytest.raises(ModelLoadError, match="a snapshot is written from one rank"):
            snapshot.write(llm.engine, str(tmp_path / "snap"))
        worker = llm.engine.runner.workers.procs[0]
    assert worker.exitcode == 0  # stopped on leaving the block


def test_fewer_kv_heads_than_ranks_then_a_killed_worker():
    """dummy:tiny-draft has 2 heads and 1 KV head: both ranks hold a copy of it. Seeded sampling
    at temperature 1 follows the logits' every digit, so it shows them equal where greedy would
    not (near-uniform random logits). Then its worker is killed: a clear error, every time."""
    prompts = [[5, 9, 200, 31, 7], list(range(40, 90))]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    want = run(LLM("dummy:tiny-draft", show_progress=False, device="cpu", kv_cache_memory="16MiB"))
    assert len(set(want[0])) > 3  # not one repeated token
    llm = LLM("dummy:tiny-draft", show_progress=False, device="cpu", tensor_parallel_size=2, kv_cache_memory="16MiB")
    assert llm.engine.runner.arch.num_kv_heads == 1
    assert run(llm) == want
    worker = llm.engine.runner.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    for _ in range(2):
        with pytest.raises(WorkerDiedError, match=r"rank 1\) exited with code -9"):
            run(llm)
    llm.shutdown()


@pytest.mark.slow  # three ranks of the default model's real weights (GGUF, dequantized per rank)
def test_default_model_on_three_ranks(tokenizer):
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    one = _greedy(LLM(show_progress=False, device="cpu", kv_cache_memory="256MiB"), prompts)
    with LLM(show_progress=False, device="cpu", kv_cache_memory="256MiB", tensor_parallel_size=3) as llm:
        assert llm.engine.runner.arch.num_kv_heads == 1
        assert _greedy(llm, prompts) == one


@pytest.mark.parametrize("bad", [0, -1, 65, 2**63, 1.5, float("nan"), "2", None, True])
def test_bad_sizes_name_the_field(bad):
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: must be an integer in \[1, 64\]"):
        EngineConfig(tensor_parallel_size=bad)


def test_shapes_and_options_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 does not divide the model's 9 attention "
                                          r"heads; sizes this model allows: \[1, 3\]"):
        LLM(tensor_parallel_size=2, show_progress=False, device="cpu")  # the default model: 9 heads, 3 KV heads
    with pytest.raises(ConfigError, match="does not divide the model's MLP width"):
        check_shape(2, 4, 2, 129, cpu)
    with pytest.raises(ConfigError, match="3 KV heads must divide one another"):
        check_shape(2, 6, 3, 128, cpu)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match=r"needs 64 GPUs \(one per rank\)"):
            check_shape(64, 64, 8, 128, cuda)
    with pytest.raises(ConfigError, match="^speculative_config: is not supported with tensor_parallel_size 2"):
        EngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    with pytest.raises(ConfigError, match="^async_scheduling: is not supported"):
        EngineConfig(tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ConfigError, match="^tensor_parallel_size: calibration runs on one rank"):
        calibrate("dummy:tiny", output="unused.json", tensor_parallel_size=2)
