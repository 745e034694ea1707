"""A prefill instance in its own process for the disaggregation tests.

    python tests/disagg_proc.py CONFIG_JSON          an LLM producer: reads prompts (one JSON
        list of strings per line on stdin), prefills them (max_tokens=1), prints one JSON list
        of their kv_transfer_params per line; exits when stdin closes
    python tests/disagg_proc.py CONFIG_JSON --die    a producer that connects, announces a
        prompt's blocks and dies before sending their bytes (a crash mid-transfer)
"""
from __future__ import annotations

import json
import os
import sys
import time


def make_llm(cfg: dict):
    from kvserve import LLM
    cfg = dict(cfg)
    if cfg.pop("context_sensitive", False):
        from tests.kvtier.tierutil import context_sensitive
        return context_sensitive(LLM(**cfg))
    return LLM(**cfg)


def serve(cfg: dict) -> None:
    from kvserve import SamplingParams
    llm = make_llm(cfg)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    print("ready", flush=True)
    eng = llm.engine
    for line in sys.stdin:
        if json.loads(line) == "drain":  # until the consumer acknowledged every transfer
            while eng.kv_transfer.held():
                time.sleep(0.02)
                eng.housekeeping()
            assert eng.kv.pool.num_used_blocks == 0
            print("drained", flush=True)
            continue
        outs = llm.generate(json.loads(line), params)
        eng.check_invariants()  # (blocks held for a CudaIpcConnector consumer count as references)
        assert eng.kv.pool.num_used_blocks == len(set(eng.kv_transfer.held()))
        print(json.dumps([o.kv_transfer_params for o in outs]), flush=True)


def die_mid_transfer(cfg: dict) -> None:
    import torch

    from kvserve.kvtier.transfer import MAGIC, Channel
    # The layout a real producer would send: an engine's own, built without a channel.
    llm = make_llm(dict(cfg, kv_transfer_config=None))
    eng = llm.engine
    from kvserve.config import KVTransferConfig
    kt = KVTransferConfig.from_dict(json.loads(sys.argv[1])["kv_transfer_config"])
    data = eng.runner.kv_cache.data
    ch = Channel(kt, data.device)
    ch.handshake({"kv_cache_dtype": eng.config.cache.kv_cache_dtype, "block_size": eng.block_size,
                  "block_shape": list(eng.runner.kv_cache.block_shape), "dtype": str(data.dtype),
                  "cache_key": eng.kv.hash_extra.decode(errors="replace")})
    keys = json.loads(sys.stdin.readline())  # hex keys the consumer's request waits for
    nbytes = len(keys) * data[:, :, 0].numel() * data.element_size()
    meta = torch.frombuffer(bytearray(json.dumps({"id": "x1", "keys": keys}).encode()), dtype=torch.uint8)
    ch.send(torch.tensor([MAGIC, nbytes, meta.numel()], dtype=torch.int64))
    ch.send(meta)
    print("announced", flush=True)
    os._exit(1)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    if "--die" in sys.argv:
        die_mid_transfer(config)
    else:
        serve(config)
