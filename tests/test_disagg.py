"""Disaggregated prefill and decode (kvserve/kvtier/transfer.py): a prefill instance in another
process hands its prompts' KV to this one, over gloo or through the disk tier; the decode side's
greedy output must equal one engine's, with the prompt's full blocks counted as cached, and a
transfer that fails must cost only the recomputation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import KVTransferConfig
from kvserve.errors import ConfigError, InvalidRequestError
from tests.kvtier.tierutil import BLOCK, MODEL, Prompts, context_sensitive, prefix_keys
from tests.prompts import LONG_DOC, ZEN
from tests.server.server_proc import free_port

SMOL = {"kv_cache_memory": "48MiB", "show_progress": False, "max_model_len": 1024}
SMOL_PROMPTS = [ZEN[:400], LONG_DOC[:300], "Q: What is 12 times 12?\nA:" + ZEN[500:700]]
# The fault paths on the context-sensitive dummy:tiny (tests/kvtier/tierutil.py), seconds each.
TINY = {"model": MODEL, "device": "cpu", "dtype": "float32", "kv_cache_memory": "4MiB", "show_progress": False,
        "context_sensitive": True}
_P = Prompts()
TINY_PROMPTS = [{"prompt_token_ids": t} for t in (_P.a, _P.b[:200], _P.other + _P.tail)]
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disagg_proc.py")


def make_llm(cfg: dict, **kw) -> LLM:
    cfg = {**cfg, **kw}
    redraw = cfg.pop("context_sensitive", False)
    llm = LLM(**cfg)
    return context_sensitive(llm) if redraw else llm


def torch_cfg(role: str, port: int, **kw) -> dict:
    return {"kv_connector": "TorchDistributedConnector", "kv_role": role, "kv_port": port, **kw}


class Producer:
    """A prefill instance (tests/disagg_proc.py) in a child process."""

    def __init__(self, config: dict, die: bool = False):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(HELPER)),
                                                                          os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, HELPER, json.dumps(config), *(["--die"] if die else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, line) -> str:
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def prefill(self, prompts: list) -> list[dict]:
        assert self.proc.stdout.readline().strip() == "ready"
        return json.loads(self.ask(prompts))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tiny_reference() -> list[list[int]]:
    """One engine, no disaggregation: the tokens every decode instance must produce."""
    return [o.outputs[0].token_ids for o in make_llm(TINY).generate(TINY_PROMPTS, greedy())]


def decode(llm: LLM, prompts: list, params: list[dict]):
    outs = llm.generate(prompts, [greedy(kv_transfer_params=p) for p in params])
    llm.engine.check_invariants()
    assert llm.engine.kv.pool.num_used_blocks == 0  # no block leaked
    return outs


def full_blocks(llm: LLM, prompt) -> int:
    """Prompt tokens in full blocks a decode instance can load (one token is always computed)."""
    return (len(llm.engine.tokenize_prompt(prompt)[1]) - 1) // BLOCK * BLOCK


@pytest.mark.slow
def test_gloo_prefill_then_decode_matches_one_engine():
    reference = [o.outputs[0].token_ids for o in make_llm(SMOL).generate(SMOL_PROMPTS, greedy())]
    port = free_port()
    producer = Producer({**SMOL, "kv_transfer_config": torch_cfg("kv_producer", port)})
    try:
        llm = make_llm(SMOL, kv_transfer_config=torch_cfg("kv_consumer", port))  # meets the producer
        params = producer.prefill(SMOL_PROMPTS)
        assert all(p["do_remote_prefill"] and p["transfer_id"] and p["num_blocks"] > 0 for p in params)
        outs = decode(llm, SMOL_PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == reference
        # Every full block the decode side needed came from the producer, none computed here.
        assert [o.num_cached_tokens for o in outs] == [full_blocks(llm, p) for p in SMOL_PROMPTS]
        assert llm.engine.kv_transfer.consumer.failed_transfers == 0
        # Without kv_transfer_params a request is served as on any engine.
        plain = llm.generate(["Hello there, " + SMOL_PROMPTS[0][:50]], greedy())
        assert plain[0].num_cached_tokens == 0
    finally:
        producer.close()


def test_gloo_on_random_weights(tiny_reference):
    port = free_port()
    producer = Producer({**TINY, "kv_transfer_config": torch_cfg("kv_producer", port)})
    try:
        llm = make_llm(TINY, kv_transfer_config=torch_cfg("kv_consumer", port))
        params = producer.prefill(TINY_PROMPTS)
        outs = decode(llm, TINY_PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        assert [o.num_cached_tokens for o in outs] == [full_blocks(llm, p) for p in TINY_PROMPTS]
    finally:
        producer.close()


def test_producer_dying_mid_transfer_means_local_prefill(tiny_reference):
    port = free_port()
    producer = Producer({**TINY, "kv_transfer_config": torch_cfg("kv_producer", port)}, die=True)
    try:
        llm = make_llm(TINY, kv_transfer_config=torch_cfg("kv_consumer", port,
                                                          kv_connector_extra_config={"transfer_timeout_s": 120}))
        keys = [k.hex() for k in prefix_keys(llm, TINY_PROMPTS[0]["prompt_token_ids"])]
        assert producer.ask(keys).strip() == "announced"  # header and keys sent, blocks never
        producer.proc.wait(timeout=60)
        t0 = time.monotonic()
        outs = decode(llm, TINY_PROMPTS, [{"do_remote_prefill": True, "transfer_id": "x1"}] * len(TINY_PROMPTS))
        assert time.monotonic() - t0 < 60  # did not wait for the 120 s timeout
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        assert [o.metrics.num_loaded_tokens for o in outs] == [0] * len(TINY_PROMPTS)  # all computed here
        assert llm.engine.kv_transfer.consumer.dead
    finally:
        producer.close()


def test_transfer_timeout_means_local_prefill(tiny_reference):
    """A consumer whose producer never sends: the request waits ``transfer_timeout_s``, no more."""
    port = free_port()
    producer = Producer({**TINY, "kv_transfer_config": torch_cfg("kv_producer", port)})
    try:
        llm = make_llm(TINY, kv_transfer_config=torch_cfg("kv_consumer", port,
                                                          kv_connector_extra_config={"transfer_timeout_s": 0.5}))
        outs = decode(llm, TINY_PROMPTS, [{"do_remote_prefill": True, "transfer_id": "neverSent"}] * 3)
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        assert [o.metrics.num_loaded_tokens for o in outs] == [0] * len(TINY_PROMPTS)  # all computed here
        # (b's prompt lies inside a's: found in the prefix cache here if a ran before b's wait ended)
        assert llm.engine.kv_transfer.consumer.timeouts >= len(TINY_PROMPTS) - 1
    finally:
        producer.close()


def test_disk_tier_prefill_then_decode_matches_one_engine(tiny_reference, tmp_path):
    tiers = {"disk_kv_dir": str(tmp_path / "kv"), "kv_tier_secret": "s" * 32}
    kvt = {"kv_connector": "KVTierConnector"}
    producer = Producer({**TINY, **tiers, "kv_transfer_config": {**kvt, "kv_role": "kv_producer"}})
    try:
        # The consumer starts first: its disk index is empty and must pick up the producer's chunks.
        llm = make_llm(TINY, **tiers, kv_transfer_config={**kvt, "kv_role": "kv_consumer"})
        params = producer.prefill(TINY_PROMPTS)
        assert all(p["do_remote_prefill"] and p["num_blocks"] > 0 for p in params)
        outs = decode(llm, TINY_PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        assert [o.num_cached_tokens for o in outs] == [full_blocks(llm, p) for p in TINY_PROMPTS]
        # Each distinct block came from the disk once (b's lie inside a's: the later one hits the GPU).
        distinct = {k for p in TINY_PROMPTS for k in prefix_keys(llm, p["prompt_token_ids"][:full_blocks(llm, p)])}
        assert llm.engine.store.load_stats.tokens_loaded["disk"] == len(distinct) * BLOCK
        assert sum(o.metrics.num_loaded_tokens for o in outs) == len(distinct) * BLOCK
    finally:
        producer.close()


def test_mismatched_kv_cache_dtype_is_refused():
    port = free_port()
    producer = Producer({**TINY, "kv_cache_dtype": "int8", "kv_transfer_config": torch_cfg("kv_producer", port)})
    try:
        with pytest.raises(ConfigError, match=r"kv_cache_dtype.*'int8'.*'auto'"):
            make_llm(TINY, kv_transfer_config=torch_cfg("kv_consumer", port))
        assert producer.proc.wait(timeout=60) != 0  # refused on its side too
    finally:
        producer.close()


@pytest.mark.unit
@pytest.mark.parametrize("cfg, field", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "kv_connector"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "prefill"}, "kv_role"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_both"}, "kv_role"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_port": 0}, "kv_port"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_port": 65536}, "kv_port"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_port": 2**63}, "kv_port"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_port": "80"}, "kv_port"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_port": True}, "kv_port"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_rank": 0}, "kv_rank"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_rank": 5}, "kv_rank"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_parallel_size": 3},
     "kv_parallel_size"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_ip": ""}, "kv_ip"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_ip": "a b"}, "kv_ip"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_buffer_size": float("nan")},
     "kv_buffer_size"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_buffer_size": -1},
     "kv_buffer_size"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"transfer_timeout_s": float("inf")}}, "transfer_timeout_s"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"nope": 1}}, "kv_connector_extra_config.nope"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": []}, "kv_connector_extra_config"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
      "kv_load_failure_policy": "fail"}, "kv_load_failure_policy"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer", "kv_portt": 1}, "kv_portt"),
    ({"kv_role": "kv_consumer"}, "kv_connector"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": None}, "kv_role"),
    ('{"kv_connector": ', "kv_transfer_config"),
    ([1], "kv_transfer_config"),
])
def test_bad_kv_transfer_config(cfg, field):
    with pytest.raises(ConfigError) as e:
        KVTransferConfig.from_dict(cfg)
    assert e.value.option.startswith("kv_transfer_config") and field in str(e.value)


@pytest.mark.unit
def test_kv_tier_connector_needs_a_shared_tier():
    from kvserve.config import EngineConfig
    with pytest.raises(ConfigError, match="disk_kv_dir or redis_url"):
        EngineConfig(kv_transfer_config=KVTransferConfig("KVTierConnector", "kv_consumer"))


@pytest.mark.unit
@pytest.mark.parametrize("params, field", [
    ([], "kv_transfer_params"), ({"do_remote_prefill": 1}, "kv_transfer_params.do_remote_prefill"),
    ({"transfer_id": "../x"}, "kv_transfer_params.transfer_id"), ({"transfer_id": "a" * 65}, "transfer_id"),
    ({"num_blocks": 2**63}, "kv_transfer_params.num_blocks"), ({"num_blocks": -1}, "num_blocks"),
    ({"other": True}, "kv_transfer_params"), ({"transfer_id": "é"}, "transfer_id"),
])
def test_bad_kv_transfer_params(params, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(kv_transfer_params=params)
    assert e.value.field.startswith("kv_transfer_params") and field in str(e.value)
