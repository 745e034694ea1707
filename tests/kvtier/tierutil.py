"""Constants, prompts and helpers shared by the KV tier tests (the fixtures are in conftest.py).

The engines run ``dummy:tiny`` (a 2-layer Llama shape, fp32 on the CPU) with its random weights
redrawn larger by ``context_sensitive``: with the preset's small weights attention is nearly
uniform and the greedy continuation barely depends on the prefix, so a wrong block of KV could
go unnoticed; with these, changing one token anywhere in the prefix usually changes it. The
tests compare each tiered run with a recomputation on the same weights, which is what they
check: the KV that comes back from a tier is the KV that was computed.
"""
from __future__ import annotations

import random
import shutil
import time

import torch

from kvserve import LLM, SamplingParams

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

MODEL = "dummy:tiny"
VOCAB = 512
WEIGHT_SEED, WEIGHT_STD = 1234, 0.3
BLOCK = 16
KV_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # 2 layers x K/V x 16 tokens x 2 KV heads x head dim 16 x fp32
PREFIX_LEN = 310  # not a multiple of the block size: 19 full blocks = 304 tokens can come from a tier
LOADABLE = PREFIX_LEN // BLOCK * BLOCK
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def blocks(n: int) -> int:
    """The bytes of ``n`` KV blocks (a size for ``kv_cache_memory`` / ``cpu_kv_memory``)."""
    return n * KV_BLOCK_BYTES


# 24 blocks: one prompt with its new tokens fits (21 blocks), and one flood of two 12-block
# prompts evicts everything.
KV_SMALL_BLOCKS = 24
KV_SMALL = blocks(KV_SMALL_BLOCKS)
KV_SESSIONS = blocks(34)  # a conversation's two turns and a little traffic beside them
CPU_BIG = blocks(91)  # holds every block the tests make


# -- the model ----------------------------------------------------------------------
def context_sensitive(llm: LLM) -> LLM:
    """Redraw ``llm``'s matrices from N(0, WEIGHT_STD) (fixed seed; norms stay 1), in place."""
    g = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for _, p in sorted(llm.engine.runner.model.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)
    return llm


def tiny_llm(**kw) -> LLM:
    """An engine on the context-sensitive ``dummy:tiny`` (float32 on the CPU)."""
    kw.setdefault("show_progress", False)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return context_sensitive(LLM(MODEL, **kw))


class FakeClock:
    """Monotonic seconds that move only when told. Starts at the real clock's reading, so a
    deadline taken from the real clock before it was installed is not in its far future."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- prompts ------------------------------------------------------------------------
class Prompts:
    """Token ids (the dummy model has no tokenizer): a shared prefix, three prompts that
    continue it differently, and more ids for the later turns of a conversation."""

    def __init__(self, seed: int = 2024):
        rng = random.Random(seed)
        ids = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
        self.prefix = ids(PREFIX_LEN)
        self.a = self.prefix + ids(8)
        self.b = self.prefix + ids(9)
        self.c = self.prefix + ids(10)
        self.tail = ids(38)
        self.other = ids(3)


# -- references ------------------------------------------------------------------------
class Reference:
    """Greedy outputs by plain recomputation: a fresh engine without tiers or prefix caching,
    so every prompt is computed from its first token. Cached per prompt."""

    def __init__(self, make):
        self._make = make
        self._llm: LLM | None = None
        self._out: dict[tuple, list[int]] = {}

    def __call__(self, *token_lists: list[int]) -> list[int] | list[list[int]]:
        missing = [t for t in dict.fromkeys(tuple(x) for x in token_lists) if t not in self._out]
        if missing:
            if self._llm is None:
                self._llm = self._make()
            outs = self._llm.generate([{"prompt_token_ids": list(t)} for t in missing], GREEDY, use_tqdm=False)
            for t, o in zip(missing, outs, strict=True):
                assert o.metrics.num_cached_tokens == 0 and o.metrics.num_loaded_tokens == 0
                self._out[t] = list(o.outputs[0].token_ids)
        res = [self._out[tuple(x)] for x in token_lists]
        return res[0] if len(res) == 1 else res


# -- helpers used by several modules ---------------------------------------------------------------
def prefix_keys(llm: LLM, tokens: list[int]) -> list[bytes]:
    """The chunk keys of the full blocks of ``tokens`` (the prefix cache's chained hashes)."""
    from kvserve.engine.kv_cache_manager import hash_block
    kv = llm.engine.kv
    keys, parent = [], b""
    for i in range(len(tokens) // kv.block_size):
        parent = hash_block(parent, kv.hash_extra, tokens[i * kv.block_size:(i + 1) * kv.block_size])
        keys.append(parent)
    return keys


def favor_loading(llm: LLM) -> None:
    """Pin the load-or-recompute cost model to a slow prefill, so that every tier is worth
    loading from whatever the machine's speed: the tests that check a path check the path, not
    the policy (test_cost_model_* check the policy)."""
    cost = llm.engine.store.cost
    cost.prefill_tokens_per_s = 50.0
    cost.observe_prefill = lambda tokens, seconds: None


def evict_from_gpu(llm: LLM, tokens: list[int], seed: int = 1) -> None:
    """Run unrelated prompts until no block of ``tokens`` is left in the GPU prefix cache (one
    batch of two prompts of half the pool each takes every block), then wait for the tier writes."""
    rng = random.Random(seed)
    keys = prefix_keys(llm, tokens)
    pool = llm.engine.kv.pool
    n_tok = llm.engine.num_kv_blocks // 2 * BLOCK
    for _ in range(4):
        if all(pool.lookup(k) is None for k in keys):
            break
        flood = [{"prompt_token_ids": [rng.randrange(1, VOCAB) for _ in range(n_tok)]} for _ in range(2)]
        llm.generate(flood, ONE, use_tqdm=False)
    assert all(pool.lookup(k) is None for k in keys), "flooding did not evict the prefix from the GPU"
    if llm.engine.store is not None:
        llm.engine.store.flush()


def forget_cpu_tier(llm: LLM) -> None:
    """Empty the CPU tier, as memory pressure or a restart would (the lower tiers keep theirs)."""
    cpu = llm.engine.store.cpu
    assert not cpu.pins
    cpu.clear()


def gen(llm: LLM, tokens: list[int], params: SamplingParams = GREEDY, **kw):
    return llm.generate({"prompt_token_ids": list(tokens)}, params, use_tqdm=False, **kw)[0]
