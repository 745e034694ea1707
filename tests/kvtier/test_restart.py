"""A second process finds the KV a first one left in the disk directory or in Redis: it loads
the long prefix instead of recomputing it, and its output is the recomputed one. An engine on
other weights finds nothing there."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from tierutil import KV_SMALL, LOADABLE, MAX_TOKENS, evict_from_gpu, gen, prefix_keys

from kvserve import LLM, SamplingParams

# The second process: a fresh interpreter, the same model, only the tier options given. Its cost
# model is left as it starts (nothing measured yet), as in a real restart.
SECOND = r"""
import json, sys
a = json.loads(sys.argv[1])
sys.path.insert(0, a["here"])
from tierutil import tiny_llm
from kvserve import SamplingParams
llm = tiny_llm(kv_cache_memory=a["kv"], **a["tiers"])
out = llm.generate({"prompt_token_ids": a["prompt"]},
                   SamplingParams(max_tokens=a["max_tokens"], temperature=0, ignore_eos=True), use_tqdm=False)[0]
snap = llm.engine.store.snapshot()
print("RESULT " + json.dumps({
    "tokens": out.outputs[0].token_ids, "cached": out.metrics.num_cached_tokens,
    "loaded": out.metrics.num_loaded_tokens, "tokens_loaded": snap["load"]["tokens_loaded"],
    "tiers": {k: {f: snap[k][f] for f in ("hits", "corrupt", "available", "errors")}
              for k in ("disk", "redis") if k in snap},
}))
"""


def _second_process(prompt: list[int], tiers: dict) -> dict:
    arg = json.dumps({"here": os.path.dirname(os.path.abspath(__file__)), "kv": KV_SMALL, "tiers": tiers,
                      "prompt": prompt, "max_tokens": MAX_TOKENS})
    p = subprocess.run([sys.executable, "-c", SECOND, arg], check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_restart_reuses_the_disk_directory(make_llm, prompts, reference, tmp_path):
    kv_dir = str(tmp_path / "kv")
    first = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir)
    ref_a, ref_b = reference(prompts.a, prompts.b)
    assert gen(first, prompts.a).outputs[0].token_ids == ref_a
    first.engine.store.flush()
    keys = prefix_keys(first, prompts.prefix)
    assert all(k in first.engine.store.disk for k in keys)  # written through as they were computed
    first.shutdown()
    del first

    res = _second_process(prompts.b, {"disk_kv_dir": kv_dir})
    assert res["cached"] == 0
    assert res["loaded"] == LOADABLE
    assert res["tokens_loaded"] == {"cpu": 0, "disk": LOADABLE, "redis": 0}
    assert res["tiers"]["disk"]["hits"] >= len(keys) and res["tiers"]["disk"]["corrupt"] == 0
    assert res["tokens"] == ref_b


def test_restart_reuses_redis(make_llm, prompts, reference, redis_server, tmp_path):
    first = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    ref_a, ref_b = reference(prompts.a, prompts.b)
    assert gen(first, prompts.a).outputs[0].token_ids == ref_a
    evict_from_gpu(first, prompts.prefix)  # evicted blocks are written to Redis (and flushed)
    keys = prefix_keys(first, prompts.prefix)
    r = redis_server.client()
    assert all(r.exists(b"kvserve:kv:" + k.hex().encode()) for k in keys)
    del first

    res = _second_process(prompts.b, {"redis_url": str(redis_server)})
    assert res["cached"] == 0
    assert res["loaded"] == LOADABLE
    assert res["tokens_loaded"] == {"cpu": 0, "disk": 0, "redis": LOADABLE}
    assert res["tiers"]["redis"]["available"] and res["tiers"]["redis"]["corrupt"] == 0
    assert res["tokens"] == ref_b


def test_chunks_of_other_weights_never_load(tmp_path):
    """Same preset, same path, different weights (seed): the keys differ, nothing is loaded."""
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [random.Random(1).randrange(1, 500) for _ in range(200)]}
    a = LLM("dummy:tiny", seed=0, kv_cache_memory="1MiB", disk_kv_dir=str(tmp_path), show_progress=False)
    a.generate(prompt, sp, use_tqdm=False)
    assert a.engine.flush_kv_to_tiers() > 0
    same = LLM("dummy:tiny", seed=0, kv_cache_memory="1MiB", disk_kv_dir=str(tmp_path), show_progress=False)
    assert same.generate(prompt, sp, use_tqdm=False)[0].metrics.num_loaded_tokens > 0
    other = LLM("dummy:tiny", seed=1, kv_cache_memory="1MiB", disk_kv_dir=str(tmp_path), show_progress=False)
    out = other.generate(prompt, sp, use_tqdm=False)[0]
    assert out.metrics.num_loaded_tokens == 0 and out.metrics.num_cached_tokens == 0
