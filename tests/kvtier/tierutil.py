"""Constants, prompts and helpers shared by the KV tier tests (the fixtures are in conftest.py)."""
from __future__ import annotations

import random
import shutil

from kvserve import LLM, SamplingParams

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

BLOCK = 16
PREFIX_LEN = 310  # not a multiple of the block size: 19 full blocks = 304 tokens can come from a tier
LOADABLE = PREFIX_LEN // BLOCK * BLOCK
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
# 24 blocks of this model (30 layers x 3 KV heads x 64 dims x fp32 = 720 KiB a block): one prompt
# with its new tokens fits (21 blocks), and one flood of two 12-block prompts evicts everything.
KV_SMALL = "17MiB"
KV_SMALL_BLOCKS = 24

_TEXT = """\
The history of the lighthouse is a history of people trying to make the sea a little less
dangerous. Long before electric lamps, fires were kept burning on hills and towers near harbours
so that ships returning at night could find the entrance. The Pharos of Alexandria, built in the
third century BC, was counted among the wonders of the ancient world; travellers wrote that its
light could be seen from far out at sea, and its name became the word for lighthouse in several
languages. For centuries afterwards most lights were simple: a coal or wood fire in an iron
basket, later candles behind glass, and still later oil lamps with wicks. Keepers had to trim the
wicks, polish the glass and keep the flame steady through storms, often living for months on
rocks far from any town. In the eighteenth century the Argand lamp, with its hollow circular wick
and glass chimney, gave a much brighter and cleaner flame, and reflectors of polished metal began
to gather its light into a beam. The great change came in 1822, when Augustin Fresnel presented a
lens made of concentric rings of glass prisms. A Fresnel lens could bend almost all of the light
from a lamp into a narrow horizontal beam, and it was far lighter and thinner than a solid lens of
the same power. Within a few decades Fresnel lenses were installed along the coasts of France,
Britain and the United States. Lights were given characters, patterns of flashes and eclipses, so
that a sailor could tell one light from another: one might flash white every five seconds, another
show two red flashes every fifteen. Fog signals were added, first bells and cannon, then sirens
and horns driven by compressed air. In the twentieth century electric lamps replaced oil, and
automatic systems slowly replaced the keepers themselves. Today most lighthouses run unattended,
monitored from far away, and satellite navigation has made many of them less important than they
once were. Yet they are still maintained, both as aids to navigation and as monuments to the
people who kept them, and many have become museums where visitors can climb the narrow stairs,
look at the huge lenses and imagine the long nights of the keepers who watched over the sea.
Sailors still speak of the relief of seeing a familiar light after a long night at sea.
"""


# -- prompts ------------------------------------------------------------------------
class Prompts:
    def __init__(self, tokenizer):
        ids = tokenizer.encode(_TEXT, add_special_tokens=False)
        assert len(ids) >= PREFIX_LEN + 40, len(ids)
        self.prefix = ids[:PREFIX_LEN]
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
        self.a = self.prefix + enc(" Question: who invented the lens?")
        self.b = self.prefix + enc(" In one sentence, the main idea is")
        self.c = self.prefix + enc(" A good title for this text would be")
        self.tail = ids[PREFIX_LEN + 2:PREFIX_LEN + 40]  # more real text, for multi-turn prompts
        self.enc = enc


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
        flood = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n_tok)]} for _ in range(2)]
        llm.generate(flood, ONE, use_tqdm=False)
    assert all(pool.lookup(k) is None for k in keys), "flooding did not evict the prefix from the GPU"
    if llm.engine.store is not None:
        llm.engine.store.flush()


def forget_cpu_tier(llm: LLM) -> None:
    """Empty the CPU tier, as memory pressure or a restart would (the lower tiers keep theirs)."""
    cpu = llm.engine.store.cpu
    with cpu.lock:
        assert not cpu.pins
        cpu.chunks.clear()
        cpu.used = 0


def gen(llm: LLM, tokens: list[int], params: SamplingParams = GREEDY, **kw):
    return llm.generate({"prompt_token_ids": list(tokens)}, params, use_tqdm=False, **kw)[0]
