"""Scored KV eviction (SnapKV, H2O; ``kvserve/kv_eviction.py``) on a random small Llama, against
a reference written here from the policies' definitions: transformers' eager attention under a
4D mask of the blocks kept so far gives every query's softmax row (``output_attentions``), the
reference scores and evicts blocks from those, and its greedy tokens under the same mask are
the expected output. The engine must keep the same blocks and produce the same tokens, with a
budget larger than the sequence equal to no eviction; held blocks stay within the budget, the
pool's invariants hold after every step, nothing leaks, no request hits a block computed after
an eviction, and preemption recomputes what decoding kept."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_groups import NULL
from kvserve.errors import ConfigError, InvalidRequestError
from tests.test_kv_eviction import BS, make_llama, masked_greedy, prompts_of

WINDOW, KERNEL = 32, 7  # SnapKV's observation window and pooling (the engine's constants)


class Reference:
    """One request under ``policy`` and ``budget``: token by token, block by block."""

    def __init__(self, model, policy: str, budget: int, prompt: list[int]):
        self.model, self.policy, self.prompt = model, policy, prompt
        self.B = budget // BS
        self.recent = max(1, self.B // 2) if policy == "h2o" else max(1, min(math.ceil(WINDOW / BS), self.B - 1))
        self.ids = list(prompt)
        self.kept: list[bool] = []  # per block
        self.row_blocks: list[list[bool]] = []  # per query position: the kept set it saw
        self.scores = torch.zeros(0, dtype=torch.float64)
        self.trace: list[tuple[int, list[int]]] = []  # (position, kept blocks) after each eviction

    def _block_scores(self, n: int) -> torch.Tensor:
        t = torch.zeros(n * BS, dtype=torch.float64)
        t[:min(len(self.scores), n * BS)] = self.scores[:n * BS]
        if self.policy == "h2o":
            return t.view(n, BS).sum(1)
        pooled = F.avg_pool1d(t[None, None], KERNEL, 1, KERNEL // 2, count_include_pad=False)[0, 0]
        return pooled.view(n, BS).max(1).values

    def _evict_to(self, c: int, target: int) -> None:
        held = [i for i, k in enumerate(self.kept) if k]
        if len(held) <= target:
            return
        s = self._block_scores(len(self.kept))
        cands = [i for i in held if i < len(self.kept) - self.recent]
        for i in sorted(cands, key=lambda i: (float(s[i]), i))[:len(held) - target]:
            self.kept[i] = False
        self.trace.append((c, [i for i, k in enumerate(self.kept) if k]))

    @staticmethod
    def attention_mask(see: torch.Tensor):
        """The model's additive mask from ``see`` [q, k] (each row's kept keys, causally)."""
        return torch.zeros(1, 1, *see.shape).masked_fill(~see, torch.finfo(torch.float32).min)

    def scored_attention(self, attentions) -> torch.Tensor:
        """[q, k] softmax rows summed over the layers that score and their heads."""
        return torch.stack(attentions)[:, 0].sum((0, 1)).double()

    def _forward(self, upto: int):
        """Logits and the attention of rows [0, upto), each row seeing its kept set."""
        pos = torch.arange(upto)
        see = torch.zeros(upto, upto, dtype=torch.bool)
        for p in range(upto):
            blocks = torch.tensor(self.row_blocks[p]).repeat_interleave(BS)[:upto]
            see[p, :len(blocks)] = blocks & (pos[:len(blocks)] <= p)
        with torch.no_grad():
            o = self.model(torch.tensor([self.ids[:upto]]), attention_mask=self.attention_mask(see),
                           position_ids=pos[None], output_attentions=True)
        return o.logits[0], self.scored_attention(o.attentions)

    def _score(self, att, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        add = att[lo:hi].sum(0)
        if len(self.scores) < len(add):
            self.scores = torch.cat([self.scores, torch.zeros(len(add) - len(self.scores), dtype=torch.float64)])
        self.scores[:len(add)] += add

    def _open_block(self, c: int) -> None:
        """Before the query at ``c`` (a block boundary): make room for its block."""
        if self.policy == "h2o" or c > len(self.prompt):
            self._evict_to(c, self.B - 1)
        self.kept.append(True)

    def run(self, n_new: int) -> list[int]:
        P = len(self.prompt)
        for p in range(P):  # the prompt, a block at a time (H2O evicts between blocks)
            if p % BS == 0:
                if p and self.policy == "h2o":
                    _, att = self._forward(p)
                    self._score(att, p - BS, p)
                self._open_block(p)
            self.row_blocks.append(list(self.kept))
        logits, att = self._forward(P)
        self._score(att, (P - 1) // BS * BS if self.policy == "h2o" else P - WINDOW, P)
        if self.policy == "snapkv":  # the prompt is compressed once it is computed
            self._evict_to(P, self.B - (1 if P % BS == 0 else 0))
        out = []
        for _ in range(n_new):
            tok = int(logits[-1].argmax())
            out.append(tok)
            self.ids.append(tok)
            if len(out) == n_new:  # the last token is never an input
                break
            c = len(self.ids) - 1
            if c % BS == 0:
                self._open_block(c)
            self.row_blocks.append(list(self.kept))
            logits, att = self._forward(c + 1)
            if self.policy == "h2o":
                self._score(att, c, c + 1)
        return out


def drive(eng, add_at: dict[int, list[tuple]]) -> tuple[dict, dict]:
    """Step to the end, checking the pool's invariants after every step and, per scheduled
    request, that it holds at most its budget's blocks once evicting. Returns the outputs and
    each request's kept block indices in its last step."""
    out, kept = {}, {}
    schedule = eng.scheduler.schedule

    def watched():
        so = schedule()
        for s in so.scheduled:
            req, rid = s.request, s.request.request_id
            kept[rid] = [i for i, b in enumerate(s.block_table) if b != NULL]
            b = req.params.kv_budget
            if b is not None and (eng.kv.eviction == "h2o" or req.num_computed_tokens >= req.num_prompt_tokens):
                assert len(kept[rid]) * BS <= b, (rid, s.block_table)
        return so
    eng.scheduler.schedule = watched
    step = 0
    while eng.has_unfinished_requests() or any(s >= step for s in add_at):
        for args in add_at.get(step, ()):
            eng.add_request(*args)
        for o in eng.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        eng.check_invariants()
        step += 1
    eng.scheduler.schedule = schedule
    assert eng.kv.pool.num_used_blocks == 0
    return out, kept


def params(budget, n_new=12, n=1):
    return SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, kv_budget=budget, n=n)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model, path = make_llama(tmp_path_factory.mktemp("llama"))
    model.set_attn_implementation("eager")
    return model, path


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_kept_blocks_and_tokens_match_the_reference(llama, policy):
    model, path = llama
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=24,
              kv_eviction=policy)
    prompts = prompts_of((45, 30, 60), seed=7)
    budgets = (32, 40, None)
    refs = [Reference(model, policy, b, p) if b else None for p, b in zip(prompts, budgets)]
    want = [r.run(16) if r else masked_greedy(model, p, 16, None) for r, p in zip(refs, prompts)]
    out, kept = drive(llm.engine, {0: [(f"r{i}", {"prompt_token_ids": p}, params(b, 16))
                                       for i, (p, b) in enumerate(zip(prompts, budgets))]})
    for i, ref in enumerate(refs):
        assert out[f"r{i}"] == [want[i]], (policy, i)
        if ref is not None:
            assert ref.trace, "the budget evicted nothing: the test shows nothing"
            assert kept[f"r{i}"] == [b for b, k in enumerate(ref.kept) if k], (policy, i, ref.trace)
    # the policy changes the output: the reference is not the unmasked one
    assert want[0] != masked_greedy(model, prompts[0], 16, None)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_budget_above_the_sequence_is_no_eviction(llama, policy):
    model, path = llama
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=16,
              kv_eviction=policy)
    prompts = prompts_of((23, 41), seed=2)
    out, _ = drive(llm.engine, {0: [(f"r{i}", {"prompt_token_ids": p}, params(64, n=2 if i else 1))
                                    for i, p in enumerate(prompts)]})
    for i, p in enumerate(prompts):
        assert all(got == masked_greedy(model, p, 12, None) for got in out[f"r{i}"]), i


def test_evicted_blocks_are_never_prefix_hits(llama):
    """An H2O request feeds the prefix cache only blocks computed before its first eviction; a
    full-attention request on its prompt and output then hits those and gets full attention's
    output, and the budgeted request, which takes no hits, its own reference's."""
    model, path = llama
    llm = LLM(path, show_progress=False, kv_cache_memory="1MiB", block_size=BS, max_num_batched_tokens=64,
              kv_eviction="h2o")
    eng = llm.engine
    (p,) = prompts_of((40,), seed=3)
    want = Reference(model, "h2o", 24, p).run(12)
    out, _ = drive(eng, {0: [("a", {"prompt_token_ids": p}, params(24))]})
    assert out == {"a": [want]}
    cached = eng.kv.pool.num_cached_blocks
    assert 0 < cached <= 24 // BS
    longer = p + want
    out, _ = drive(eng, {0: [("b", {"prompt_token_ids": longer}, params(None))],
                         1: [("c", {"prompt_token_ids": p}, params(24))]})
    assert out == {"b": [masked_greedy(model, longer, 12, None)], "c": [want]}
    assert eng.kv.prefix_hits > 0


def test_preemption_recomputes_what_decoding_kept(llama):
    model, path = llama
    llm = LLM(path, show_progress=False, kv_cache_memory="32KiB", block_size=BS, max_num_batched_tokens=64,
              kv_eviction="h2o", decode_reserve=0)
    eng = llm.engine
    prompts = prompts_of((30, 34, 26), seed=5)
    budgets = (24, None, 16)
    out, _ = drive(eng, {0: [(f"r{i}", {"prompt_token_ids": p}, params(b, n_new=20))
                             for i, (p, b) in enumerate(zip(prompts, budgets))]})
    assert eng.scheduler.num_preemptions > 0
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        want = Reference(model, "h2o", b, p).run(20) if b else masked_greedy(model, p, 20, None)
        assert out[f"r{i}"] == [want], i


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_admission_on_the_budget(llama, policy):
    """A pool of 16 blocks: four requests of 15 blocks each at full length run side by side
    under a 3-block budget, and one of 28 blocks is accepted at all; without a budget it is
    refused."""
    _, path = llama
    llm = LLM(path, show_progress=False, kv_cache_memory="32KiB", block_size=BS, max_num_batched_tokens=256,
              kv_eviction=policy)
    eng = llm.engine
    assert eng.kv.pool.num_blocks == 16
    prompts = prompts_of((40, 40, 40, 40, 80), seed=9)
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params(13, n_new=20))
    eng.add_request("long", {"prompt_token_ids": prompts[4]}, params(13, n_new=32))
    most = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        most = max(most, len(eng.scheduler.running))
    assert most >= 4 and eng.scheduler.num_preemptions == 0
    assert eng.kv.pool.num_used_blocks == 0
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        eng.add_request("x", {"prompt_token_ids": prompts[4]}, params(None, n_new=32))


@pytest.mark.parametrize("kwargs,field", [
    (dict(kv_eviction="snapkv", attention_backend="triton"), "kv_eviction"),
    (dict(kv_eviction="h2o", attention_backend="triton"), "kv_eviction"),
    (dict(kv_eviction="h2o", async_scheduling=True), "async_scheduling"),
    (dict(kv_eviction="h2o", preemption_mode="swap"), "preemption_mode"),
    (dict(kv_eviction="snapkv", kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(kv_eviction="h2o", cpu_kv_memory="1MiB"), "cpu_kv_memory"),
])
def test_unsupported_combinations_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError) as ei:
        LLM("dummy:tiny", kv_cache_memory="1MiB", show_progress=False, **kwargs)
    assert ei.value.option == field, ei.value
