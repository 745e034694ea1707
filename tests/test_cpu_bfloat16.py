"""The CPU engine in bfloat16 (what ``dtype="auto"`` runs where the CPU multiplies bfloat16
natively; the rest of the suite runs float32) through the paths that move or rebuild its
weights: sleep at both levels and a snapshot round trip must give back the same bfloat16
weights, bit for bit, and so the same tokens and log-probabilities."""
from __future__ import annotations

import torch

from kvserve.llm import LLM
from kvserve.models import snapshot
from kvserve.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 77, 300, 12, 9, 41]}, {"prompt_token_ids": list(range(100, 160))}]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def _outputs(llm: LLM) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _weights(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.engine.runner.model
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_sleep_and_wake_give_back_the_same_bfloat16_weights():
    llm = LLM("dummy:tiny", dtype="bfloat16", kv_cache_memory="16MiB", show_progress=False,
              enable_sleep_mode=True, enable_prefix_caching=False)
    assert llm.engine.runner.dtype == torch.bfloat16
    ref, weights = _outputs(llm), _weights(llm)
    params = dict(llm.engine.runner.model.named_parameters())  # the RoPE tables stay float32
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        after = _weights(llm)
        assert after.keys() == weights.keys() and all(torch.equal(after[n], weights[n]) for n in weights)
        assert _outputs(llm) == ref
    llm.shutdown()


def test_a_bfloat16_snapshot_runs_in_bfloat16_with_the_same_outputs(tmp_path):
    src = LLM("dummy:tiny", dtype="bfloat16", kv_cache_memory="16MiB", show_progress=False)
    ref, weights = _outputs(src), _weights(src)
    manifest = snapshot.write(src.engine, str(tmp_path / "snap"))
    src.shutdown()
    assert manifest["dtype"] == "bfloat16"
    llm = LLM(str(tmp_path / "snap"), kv_cache_memory="16MiB", show_progress=False)
    assert llm.engine.runner.dtype == torch.bfloat16
    after = _weights(llm)
    assert all(torch.equal(after[n], weights[n]) for n in weights)
    assert _outputs(llm) == ref
    llm.shutdown()
