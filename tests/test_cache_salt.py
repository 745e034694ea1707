"""``cache_salt`` offline: prompts share prefix-cache blocks only with prompts of the same salt
(vLLM's prompt-dict key). Checked through each output's ``num_cached_tokens`` and the engine's
own hit counter, not timing."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="dummy:tiny", kv_cache_memory="16MiB", show_progress=False, max_model_len=512)


def _prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(1, 250), k=40)  # 2 full blocks of 16, then 8 tokens


def _run(llm, ids, salt=None):
    p = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
    hits = llm.engine.kv.prefix_hits
    out = llm.generate(p, GREEDY, use_tqdm=False)[0]
    return out, llm.engine.kv.prefix_hits - hits


def test_salted_prompts_share_only_with_their_own_salt(llm):
    ids = _prompt(1)
    bs = llm.engine.block_size
    plain, _ = _run(llm, ids)
    a, a_hits = _run(llm, ids, "tenant-a")
    assert (a.num_cached_tokens, a_hits) == (0, 0)  # the unsalted copy is not theirs
    b, b_hits = _run(llm, ids, "tenant-b")
    assert (b.num_cached_tokens, b_hits) == (0, 0)
    a2, a2_hits = _run(llm, ids, "tenant-a")
    assert (a2.num_cached_tokens, a2_hits) == (2 * bs, 2 * bs)  # its own blocks: a hit
    again, again_hits = _run(llm, ids)
    assert (again.num_cached_tokens, again_hits) == (2 * bs, 2 * bs)  # unsalted still shares
    # The salt changes where the KV is kept, never what is computed.
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.check_invariants()


@pytest.mark.parametrize("salt", ["", 7, b"bytes"])
def test_bad_salt_is_refused_naming_it(llm, salt):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate({"prompt_token_ids": _prompt(3), "cache_salt": salt}, GREEDY, use_tqdm=False)
    assert e.value.field == "cache_salt"
    assert not llm.engine.has_unfinished_requests()
