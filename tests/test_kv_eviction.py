"""Streaming KV eviction (``kvserve/kv_eviction.py``) on a random small Llama: greedy output
token-identical to transformers attending under the same sink + recent mask (a 4D mask we build
from positions, not from the engine), with chunked prefill, a batch mixing budgets, forks,
prefix-cache sharing in both directions and preemption; the pool's invariants after every step,
at most ``kv_budget`` tokens held while decoding, nothing leaked; the Triton backend's tokens equal
to the torch backend's; bad budgets refused."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError

BS = 4  # tokens per block


def make_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-zero, far from uniform logits (no near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.3)
    path = tmp_path / "llama"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def masked_greedy(model, prompt: list[int], n: int, budget: int | None) -> list[int]:
    """transformers' greedy continuation, each step over the whole sequence, every query seeing
    the first block and the blocks from ``max(1, p // BS - (budget // BS - 1) + 1)`` on."""
    ids = list(prompt)
    for _ in range(n):
        L = len(ids)
        pos = torch.arange(L)
        see = pos[None, :] <= pos[:, None]
        if budget is not None:
            start = torch.clamp(pos // BS - (budget // BS - 1) + 1, min=1) * BS
            see &= (pos[None, :] < BS) | (pos[None, :] >= start[:, None])
        mask = torch.zeros(1, 1, L, L).masked_fill(~see, torch.finfo(torch.float32).min)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=mask, position_ids=pos[None]).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts_of(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def drive(eng, add_at: dict[int, list[tuple]] | None = None) -> dict[str, list[list[int]]]:
    """Step to the end (adding ``add_at[step]``'s requests before that step), checking the
    pool's invariants and each decoding request's held tokens after every step."""
    out: dict[str, list[list[int]]] = {}
    last: dict[str, int] = {}  # computed tokens after the previous step
    step = 0
    while eng.has_unfinished_requests() or (add_at and any(s >= step for s in add_at)):
        for args in (add_at or {}).get(step, ()):
            eng.add_request(*args)
        for o in eng.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        eng.check_invariants()
        for req in eng.scheduler.running:
            budget = req.params.kv_budget
            done, rid = req.num_computed_tokens, req.request_id
            if budget is not None and done - last.get(rid, -2) == 1:  # a decode step: its blocks only
                held = sum(b >= 0 for b in eng.kv.table(req))
                assert held * BS <= budget, (rid, held, budget)
            last[rid] = done
        step += 1
    assert eng.kv.pool.num_used_blocks == 0
    return out


def params(budget, n_new=12, n=1):
    return SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, kv_budget=budget, n=n)


def test_matches_masked_reference_in_a_mixed_batch(tmp_path):
    model, path = make_llama(tmp_path)
    # A small step budget chunks the prompts; budgets of 9 (the least: sink + 1 block), 13, 20
    # tokens and none; the 3-block budget also forked (n=2), whose siblings share blocks.
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=16,
              kv_eviction="streaming", dtype="float32")  # the reference's dtype, on any device
    eng = llm.engine
    prompts = prompts_of((5, 23, 41, 30, 41))
    budgets = (9, 13, 20, None, 13)
    reqs = [(f"r{i}", {"prompt_token_ids": p}, params(b, n=2 if i == 4 else 1))
            for i, (p, b) in enumerate(zip(prompts, budgets))]
    out = drive(eng, {0: reqs})
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        want = masked_greedy(model, p, 12, b)
        assert all(got == want for got in out[f"r{i}"]), (i, b)
    # The budget changes the output: the reference is not trivially the unmasked one.
    assert out["r2"][0] != masked_greedy(model, prompts[2], 12, None)


def test_shared_blocks_survive_eviction(tmp_path):
    """A budgeted request sharing cached prefix blocks with a full-attention one drops only its
    references; each gets its own reference's output, in either order of arrival."""
    model, path = make_llama(tmp_path)
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=64,
              kv_eviction="streaming", dtype="float32")  # the reference's dtype, on any device
    eng = llm.engine
    (p,) = prompts_of((40,), seed=3)
    full, streamed = masked_greedy(model, p, 12, None), masked_greedy(model, p, 12, 13)
    # full first (its prompt cached), the budgeted one joining while it decodes; then the reverse
    out = drive(eng, {0: [("a", {"prompt_token_ids": p}, params(None))],
                      2: [("b", {"prompt_token_ids": p}, params(13))]})
    assert out == {"a": [full], "b": [streamed]}
    hits = eng.kv.prefix_hits
    assert hits > 0
    out = drive(eng, {0: [("c", {"prompt_token_ids": p}, params(13))],
                      2: [("d", {"prompt_token_ids": p}, params(None))]})
    assert out == {"c": [streamed], "d": [full]}
    assert eng.kv.prefix_hits > hits


def test_preemption_recomputes_under_the_same_mask(tmp_path):
    model, path = make_llama(tmp_path)
    # A pool of 16 blocks: the full-attention request grows to 14 and pushes the others out.
    llm = LLM(path, show_progress=False, kv_cache_memory="32KiB", block_size=BS, max_num_batched_tokens=64,
              kv_eviction="streaming", dtype="float32", decode_reserve=0)  # the reference's dtype, on any device
    eng = llm.engine
    prompts = prompts_of((30, 34, 26), seed=5)
    budgets = (13, None, 9)
    out = drive(eng, {0: [(f"r{i}", {"prompt_token_ids": p}, params(b, n_new=24))
                          for i, (p, b) in enumerate(zip(prompts, budgets))]})
    assert eng.scheduler.num_preemptions > 0
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert out[f"r{i}"] == [masked_greedy(model, p, 24, b)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's internals
def test_triton_backend_matches_torch_backend(tmp_path):
    """The Triton kernels (the interpreter on the CPU) skip and mask the evicted keys themselves:
    the same greedy tokens as the torch backend under the same budgets. A lone prompt first (its
    steps cut to its budget, the later ones after evicted blocks), then a chunked prompt beside a
    request without a budget, decode rows riding along, and decode-only steps (the RoPE + KV write
    fused into the decode kernel)."""
    _, path = make_llama(tmp_path)
    prompts = prompts_of((21, 41, 9), seed=7)
    budgets = (9, 13, None)

    def run(backend, budgets):
        llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=24,
                  kv_eviction="streaming", attention_backend=backend, dtype="float32")
        reqs = [(f"r{i}", {"prompt_token_ids": p}, params(b, n_new=8))
                for i, (p, b) in enumerate(zip(prompts, budgets))]
        return drive(llm.engine, {0: reqs[:1], 2: reqs[1:]})

    want = run("torch", budgets)
    assert run("triton", budgets) == want
    # The budgets change the output: the comparison is not between two full attentions.
    full = run("torch", (None,) * 3)
    assert want["r0"] != full["r0"] and want["r1"] != full["r1"]


@pytest.mark.parametrize("kwargs,field", [
    (dict(kv_eviction="lru"), "kv_eviction"),
    (dict(kv_eviction="streaming", kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(kv_eviction="streaming", kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(kv_eviction="streaming", preemption_mode="swap"), "preemption_mode"),
    (dict(kv_eviction="streaming", cpu_kv_memory="1MiB"), "cpu_kv_memory"),
    (dict(kv_eviction="streaming", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "kv_eviction"),
])
def test_unsupported_combinations_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError) as ei:
        LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, **kwargs)
    assert ei.value.option == field, ei.value


@pytest.mark.parametrize("budget", [0, -1, 2**31, 2**63, 1.5, float("nan"), "40", True])
def test_bad_budget_in_sampling_params(budget):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(kv_budget=budget)
    assert ei.value.field == "kv_budget" and "[1, 2147483647]" in str(ei.value)


def test_budget_out_of_range_or_without_eviction_is_refused():
    llm = LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, block_size=BS, max_model_len=64,
              kv_eviction="streaming")
    for bad in (8, 65):  # below sink + one block + one token (9), above max_model_len
        with pytest.raises(InvalidRequestError, match=r"\[9, 64\]") as ei:
            llm.engine.add_request("r", {"prompt_token_ids": [3, 4]}, SamplingParams(kv_budget=bad))
        assert ei.value.field == "kv_budget"
    plain = LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False)
    with pytest.raises(InvalidRequestError, match="--kv-eviction streaming"):
        plain.engine.add_request("r", {"prompt_token_ids": [3, 4]}, SamplingParams(kv_budget=40))
