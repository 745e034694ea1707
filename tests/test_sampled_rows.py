"""The rows turned into logits are the last token of each sampling request, whatever the step
looks like: a fork (n > 1) at the end of a prompt samples one row several times, which must not
be mistaken for a decode step where every row is sampled once (found by review: a 2-token prompt
with n=2 sampled rows 0 and 1 instead of row 1 twice)."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False)


def _greedy(llm, prompt, n=1, max_tokens=4):
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=n, max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("prompt,n", [([11, 22], 2), ([101, 202, 303], 3), ([7], 1), ([5, 6, 7, 8], 4)])
def test_greedy_forks_equal_the_single_continuation(llm, prompt, n):
    (single,) = _greedy(llm, prompt)
    assert _greedy(llm, prompt, n=n) == [single] * n


def test_a_fork_in_the_batch_leaves_other_requests_alone(llm):
    a, b = [101, 202, 303], [404]
    (alone,) = _greedy(llm, a)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                        [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert llm.engine.kv.pool.num_used_blocks == 0
