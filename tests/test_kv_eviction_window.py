"""KV eviction on a model with sliding-window layers (random small Gemma 3s): the budget bounds the
global layers, the local ones keep their window. The reference is transformers' Gemma 3 given one
4D mask per layer type, built here from positions: its global layers see what the policy keeps
(streaming: the sink and recent blocks; SnapKV/H2O: the blocks ``Reference`` keeps, scored from
the global layers' softmax rows), its sliding layers their window. Greedy output token-identical
in a mixed batch with chunked prefill; the same blocks kept; every global group (several on a
model whose global layers do not fill one page) evicting the same entries; the local groups'
window untouched; preemption recomputing the same output; nothing leaked."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_groups import NULL
from kvserve.errors import ConfigError
from tests.test_kv_eviction import BS, prompts_of
from tests.test_kv_eviction_scored import Reference, drive
from tests.test_window_kv import GLOBAL, LOCAL, make_gemma3

WINDOW = 12  # the models' sliding window: three blocks
# Five local layers and three global: page_layers 1, so three global groups that must agree.
LAYERS = [LOCAL, LOCAL, GLOBAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model, path = make_gemma3(tmp_path_factory.mktemp("gemma3"), LAYERS, window=WINDOW)
    model.set_attn_implementation("eager")
    return model, path


def masks(see_global: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer type, the additive 4D mask: global layers ``see_global`` [q, k]; sliding layers
    causal within the window."""
    n = see_global.shape[0]
    pos = torch.arange(n)
    local = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - WINDOW)
    return {GLOBAL: Reference.attention_mask(see_global), LOCAL: Reference.attention_mask(local)}


def streaming_see(n: int, budget: int | None) -> torch.Tensor:
    pos = torch.arange(n)
    see = pos[None, :] <= pos[:, None]
    if budget is not None:
        start = torch.clamp(pos // BS - (budget // BS - 1) + 1, min=1) * BS
        see &= (pos[None, :] < BS) | (pos[None, :] >= start[:, None])
    return see


def greedy(model, prompt: list[int], n: int, budget: int | None) -> list[int]:
    """transformers' greedy continuation under streaming eviction of the global layers."""
    ids = list(prompt)
    for _ in range(n):
        L = len(ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=masks(streaming_see(L, budget)),
                           position_ids=torch.arange(L)[None]).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


class WindowReference(Reference):
    """``Reference`` on Gemma 3: the kept blocks mask the global layers only, and only their
    attention scores."""

    @staticmethod
    def attention_mask(see: torch.Tensor):
        return masks(see)

    def scored_attention(self, attentions) -> torch.Tensor:
        glob = [i for i, t in enumerate(LAYERS) if t == GLOBAL]
        return super().scored_attention([attentions[i] for i in glob])


def params(budget, n_new=12, n=1):
    return SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, kv_budget=budget, n=n)


def check_groups(eng) -> None:
    """Every global group's table NULL where group 0's is; each local one a NULL prefix, then
    (at most) the window's blocks once decoding (the step that ends a prompt holds its chunk's
    blocks too: those out of the window go back when the request's next step is allocated)."""
    kv, groups = eng.kv, eng.kv_plan.groups
    assert groups.windows.count(None) == 3  # the test's premise: several global groups
    for req in eng.scheduler.running:
        tables = kv.tables_of(req)
        for g, w in enumerate(groups.windows):
            if w is None:
                assert [b == NULL for b in tables[g]] == [b == NULL for b in tables[0]], g
            else:
                held = [b for b in tables[g] if b != NULL]
                assert len(held) <= -(-(WINDOW - 1) // BS) + 2 or req.num_computed_tokens <= req.num_prompt_tokens


def run_streaming(eng, reqs, add_at_step: int = 0) -> dict:
    out = {}
    for args in reqs[:1]:
        eng.add_request(*args)
    step = 0
    while eng.has_unfinished_requests() or step <= add_at_step:
        if step == add_at_step:
            for args in reqs[1:]:
                eng.add_request(*args)
        for o in eng.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        eng.check_invariants()
        check_groups(eng)
        step += 1
    assert eng.kv.pool.num_used_blocks == 0
    return out


def test_streaming_matches_the_masked_reference(gemma):
    """Budgets of 9 tokens (below the window), 13 and 24 (above it) and none, one forked (n=2),
    prompts several windows long chunked by a 16-token step; then the same requests in a pool
    that preempts."""
    model, path = gemma
    prompts = prompts_of((41, 23, 50, 30), seed=4)
    budgets = (9, 13, 24, None)
    want = [greedy(model, p, 12, b) for p, b in zip(prompts, budgets)]
    reqs = [(f"r{i}", {"prompt_token_ids": p}, params(b, n=2 if i == 1 else 1))
            for i, (p, b) in enumerate(zip(prompts, budgets))]
    for mem in ("1MiB", "112KiB"):
        llm = LLM(path, show_progress=False, kv_cache_memory=mem, block_size=BS, max_num_batched_tokens=16,
                  kv_eviction="streaming", dtype="float32", decode_reserve=0 if mem == "112KiB" else None)
        out = run_streaming(llm.engine, reqs, add_at_step=2)
        for i in range(len(prompts)):
            assert all(got == want[i] for got in out[f"r{i}"]), (mem, i)
        if mem == "112KiB":
            assert llm.engine.scheduler.num_preemptions > 0
    # The budget changes the output: the reference is not full attention.
    assert want[2] != greedy(model, prompts[2], 12, None)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_scored_eviction_keeps_the_reference_blocks(gemma, policy):
    model, path = gemma
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=24,
              kv_eviction=policy, dtype="float32")
    eng = llm.engine
    prompts = prompts_of((45, 60), seed=7)
    budgets = (32, 40)
    refs = [WindowReference(model, policy, b, p) for p, b in zip(prompts, budgets)]
    want = [r.run(16) for r in refs]
    schedule = eng.scheduler.schedule

    def watched():
        so = schedule()
        check_groups(eng)
        return so
    eng.scheduler.schedule = watched
    out, kept = drive(eng, {0: [(f"r{i}", {"prompt_token_ids": p}, params(b, 16))
                                for i, (p, b) in enumerate(zip(prompts, budgets))]})
    for i, ref in enumerate(refs):
        assert ref.trace, "the budget evicted nothing: the test shows nothing"
        assert out[f"r{i}"] == [want[i]], (policy, i)
        assert kept[f"r{i}"] == [b for b, k in enumerate(ref.kept) if k], (policy, i, ref.trace)
    assert want[0] != greedy(model, prompts[0], 16, None)


def test_every_layer_windowed_or_windows_kept_is_a_config_error(tmp_path):
    _, path = make_gemma3(tmp_path, [LOCAL, LOCAL], window=WINDOW)
    with pytest.raises(ConfigError) as ei:
        LLM(path, kv_cache_memory="1MiB", show_progress=False, kv_eviction="streaming")
    assert ei.value.option == "kv_eviction" and "sliding window" in str(ei.value)
    _, path = make_gemma3(tmp_path / "mixed", [LOCAL, GLOBAL], window=WINDOW)
    with pytest.raises(ConfigError) as ei:
        LLM(path, kv_cache_memory="1MiB", show_progress=False, kv_eviction="h2o", window_kv="keep")
    assert ei.value.option == "window_kv"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's internals
def test_triton_backend_matches_torch_backend(gemma):
    """The Triton kernels (the interpreter on the CPU) on the global layers' streaming spans and
    the local layers' windows in one step: the torch backend's tokens."""
    _, path = gemma
    prompts = prompts_of((33, 21), seed=8)

    def run(backend):
        llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=24,
                  kv_eviction="streaming", attention_backend=backend, dtype="float32")
        return run_streaming(llm.engine, [(f"r{i}", {"prompt_token_ids": p}, params(b, n_new=8))
                                          for i, (p, b) in enumerate(zip(prompts, (9, None)))], add_at_step=1)

    assert run("triton") == run("torch")


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_admitted_on_the_budget_and_the_window(gemma, policy):
    """A 200-token prompt under a 13-token budget in a pool of 64 blocks (eight layer groups): its
    steps are cut to the budget, so each local group holds its window and about one budget's
    tokens, not a 256-token step's; it is admitted and runs alone without preemption."""
    model, path = gemma
    llm = LLM(path, show_progress=False, kv_cache_memory="64KiB", block_size=BS, max_num_batched_tokens=256,
              kv_eviction=policy, dtype="float32")
    eng = llm.engine
    assert eng.kv.pool.num_blocks == 64
    (p,) = prompts_of((200,), seed=11)
    out = run_streaming(eng, [("r", {"prompt_token_ids": p}, params(13))])
    assert eng.scheduler.num_preemptions == 0
    if policy == "streaming":
        assert out["r"] == [greedy(model, p, 12, 13)]
