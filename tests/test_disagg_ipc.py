"""CudaIpcConnector (kvserve/kvtier/ipc.py): a prefill instance in another process of this host
hands its prompts' KV over through a buffer both processes map (CUDA IPC on a GPU, a host file
on the CPU; the slots, acknowledgements and flow control are the same code). As for the gloo
transport (tests/test_disagg.py): the decode side's greedy output equals one engine's with the
prompt's full blocks counted as cached, no block leaks on either side, and a transfer that fails
costs only the recomputation. The CUDA cases run two processes on one GPU and skip without CUDA:

    python -m pytest tests/test_disagg_ipc.py
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import KVTransferConfig
from kvserve.errors import ConfigError
from kvserve.kvtier import TieredStore
from kvserve.kvtier.ipc import IpcConsumer, IpcProducer, Ring
from kvserve.kvtier.ipc_buffer import PREFIX, SharedBuffer
from kvserve.kvtier.transfer import Channel
from tests.server.server_proc import free_port
from tests.test_disagg import TINY, TINY_PROMPTS, Producer, decode, full_blocks, greedy, make_llm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC: needs CUDA")
_rng = random.Random(11)
# Four prompts of 43 full blocks (344 KiB of KV each): more than a 1 MiB buffer holds, so the
# fourth one's slot wraps round to the start.
LONG_PROMPTS = [{"prompt_token_ids": [_rng.randrange(1, 512) for _ in range(700)]} for _ in range(4)]
MIB = 2**20


def ipc_cfg(role: str, port: int, **kw) -> dict:
    return {"kv_connector": "CudaIpcConnector", "kv_role": role, "kv_port": port, **kw}


def reference(cfg: dict, prompts: list, warm: bool = False) -> list[list[int]]:
    """One engine, no disaggregation: the tokens the decode instance must produce. ``warm``: its
    prefix cache first holds the prompts, so it computes what the decode instance computes (the
    blocks after the loaded ones), in the same batches: on a GPU another batch shape may round
    differently, which would hide what the test checks (that the bytes arrived unchanged)."""
    llm = make_llm(cfg)
    for p in prompts if warm else []:  # as check_hand_over's producer computes them
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]


def wait_arrived(llm, params: list[dict], timeout: float = 120.0) -> None:
    """Until every transfer named in ``params`` reached the decode instance (so its requests all
    start in the same step, as the reference's do)."""
    consumer, deadline = llm.engine.kv_transfer.consumer, time.monotonic() + timeout
    while not all(p.get("transfer_id") in consumer.done for p in params):
        assert time.monotonic() < deadline and not consumer.dead
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny_reference() -> list[list[int]]:
    return reference(TINY, TINY_PROMPTS)


def check_hand_over(cfg: dict, prompts: list, want: list[list[int]], buffer: float = MIB) -> None:
    port = free_port()
    producer = Producer({**cfg, "kv_transfer_config": ipc_cfg("kv_producer", port, kv_buffer_size=buffer)})
    try:
        llm = make_llm(cfg, kv_transfer_config=ipc_cfg("kv_consumer", port))
        # One prompt at a time: the KV of prompts finishing together beyond kv_buffer_size
        # would not be sent. (The producer checks its pool leaks nothing.)
        params = producer.prefill(prompts[:1]) + [json.loads(producer.ask([p]))[0] for p in prompts[1:]]
        assert all(p["do_remote_prefill"] and p["transfer_id"] and p["num_blocks"] > 0 for p in params)
        wait_arrived(llm, params)
        outs = decode(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [full_blocks(llm, p) for p in prompts]
        consumer = llm.engine.kv_transfer.consumer
        assert isinstance(consumer, IpcConsumer) and consumer.failed_transfers == 0
        assert consumer.buffer.tensor.device.type == torch.device(cfg["device"]).type
    finally:
        producer.close()


# -- two processes on the CPU ---------------------------------------------------------------
def test_ipc_prefill_then_decode_matches_one_engine(tiny_reference):
    check_hand_over(TINY, TINY_PROMPTS, tiny_reference)


def test_ipc_buffer_smaller_than_the_prompts_in_flight():
    check_hand_over(TINY, LONG_PROMPTS, reference(TINY, LONG_PROMPTS))


def test_ipc_producer_killed_means_local_prefill(tiny_reference):
    port = free_port()
    producer = Producer({**TINY, "kv_transfer_config": ipc_cfg("kv_producer", port)})
    try:
        llm = make_llm(TINY, kv_transfer_config=ipc_cfg("kv_consumer", port,
                                                        kv_connector_extra_config={"transfer_timeout_s": 120}))
        first = producer.prefill(TINY_PROMPTS[:1])
        wait_arrived(llm, first)
        producer.proc.kill()
        producer.proc.wait(timeout=60)
        t0 = time.monotonic()
        never = {"do_remote_prefill": True, "transfer_id": "x1"}
        outs = decode(llm, TINY_PROMPTS, first + [never] * (len(TINY_PROMPTS) - 1))
        assert time.monotonic() - t0 < 60  # did not wait for the 120 s timeout
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        # The first prompt's blocks arrived before the producer died; the last prompt's are computed
        # here (the second one lies inside the first: its blocks are among those that arrived).
        assert outs[0].num_cached_tokens == full_blocks(llm, TINY_PROMPTS[0])
        assert outs[2].metrics.num_loaded_tokens == 0
        assert llm.engine.kv_transfer.consumer.dead and llm.engine.kv_transfer.consumer.buffer is None
    finally:
        producer.close()


def test_ipc_transfer_timeout_means_local_prefill(tiny_reference):
    port = free_port()
    producer = Producer({**TINY, "kv_transfer_config": ipc_cfg("kv_producer", port)})
    try:
        llm = make_llm(TINY, kv_transfer_config=ipc_cfg("kv_consumer", port,
                                                        kv_connector_extra_config={"transfer_timeout_s": 0.5}))
        outs = decode(llm, TINY_PROMPTS, [{"do_remote_prefill": True, "transfer_id": "neverSent"}] * 3)
        assert [o.outputs[0].token_ids for o in outs] == tiny_reference
        assert [o.metrics.num_loaded_tokens for o in outs] == [0] * len(TINY_PROMPTS)
        assert llm.engine.kv_transfer.consumer.timeouts >= len(TINY_PROMPTS) - 1
    finally:
        producer.close()


def test_ipc_mismatched_kv_cache_dtype_is_refused():
    port = free_port()
    producer = Producer({**TINY, "kv_cache_dtype": "int8", "kv_transfer_config": ipc_cfg("kv_producer", port)})
    try:
        with pytest.raises(ConfigError, match=r"kv_cache_dtype.*'int8'.*'auto'"):
            make_llm(TINY, kv_transfer_config=ipc_cfg("kv_consumer", port))
        assert producer.proc.wait(timeout=60) != 0  # refused on its side too
    finally:
        producer.close()


# -- the slots and acknowledgements, both ends in this process --------------------------------
SHAPE, BLOCK_BYTES = (2, 4), 32  # float32 blocks of 8 values


def connecting(buffer_bytes: int, timeout_s: float = 30.0) -> tuple[list, TieredStore]:
    """Both ends connecting, each in a thread: the futures of the producer and the consumer."""
    port, store = free_port(), TieredStore(SHAPE, torch.float32, torch.device("cpu"))

    def side(role):
        ch = Channel(KVTransferConfig("CudaIpcConnector", role, kv_port=port), torch.device("cpu"))
        if role == "kv_producer":
            return IpcProducer(ch, torch.device("cpu"), BLOCK_BYTES, buffer_bytes, timeout_s)
        return IpcConsumer(ch, store, timeout_s)

    with ThreadPoolExecutor(2) as ex:
        return [ex.submit(side, role) for role in ("kv_producer", "kv_consumer")], store


def connect(buffer_bytes: int, timeout_s: float = 30.0) -> tuple[IpcProducer, IpcConsumer, TieredStore]:
    (producer, consumer), store = connecting(buffer_bytes, timeout_s)
    return producer.result(), consumer.result(), store


def blocks_of(i: int, n: int) -> tuple[list[bytes], torch.Tensor]:
    keys = [f"t{i}-b{j}".encode().ljust(32, b".") for j in range(n)]
    return keys, torch.arange(n * 8, dtype=torch.float32).view(n, *SHAPE) + 1000 * i


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_buffer_smaller_than_a_block_is_refused_on_both_sides():
    (producer, consumer), _ = connecting(BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="kv_buffer_size.*cannot hold one KV block"):
        producer.result()
    with pytest.raises(ConfigError, match="kv_buffer_size.*could not allocate"):  # (not left waiting)
        consumer.result()


@pytest.mark.unit
def test_ring_slots_wrap_and_free_in_order():
    r = Ring(100)
    assert (r.alloc(40), r.alloc(40), r.alloc(30)) == (0, 40, None)  # 20 left at the end: too short
    r.free(0)
    assert r.alloc(30) == 0  # wraps: the tail's 20 bytes wait
    assert (r.alloc(10), r.alloc(1)) == (30, None)  # wrapped: only up to the oldest slot
    with pytest.raises(RuntimeError, match="offset 30"):
        r.free(30)
    r.free(40)
    assert r.alloc(70) is None and r.alloc(60) == 40 and r.used == 100 and r.alloc(1) is None
    for off in (0, 30, 40):
        r.free(off)
    assert (r.alloc(50), r.alloc(50), r.alloc(1)) == (0, 50, None)  # empty: the next slot starts at 0 anyway
    r.free(0)
    assert r.alloc(30) == 0 and r.alloc(20) == 30  # (round the buffer, not back to 0 each time)
    r.free(50)
    r.free(0)
    r.free(30)
    assert r.alloc(40) == 50


def test_slots_flow_and_oversized_prompts_are_refused(caplog):
    producer, consumer, store = connect(3 * BLOCK_BYTES)
    # The file's name is gone once both processes mapped it: nothing is left if they die.
    assert producer.buffer.path is None and not os.path.exists(producer.buffer.handle["path"])
    sent = [blocks_of(i, 1 + i % 3) for i in range(8)]  # 15 blocks through a buffer of 3
    tids = []
    for keys, kv in sent:  # (what waits to be sent is bounded by kv_buffer_size too: retry)
        while (tid := producer.send(keys, kv)) is None:
            time.sleep(0.001)
        tids.append(tid)
    with caplog.at_level(logging.ERROR, logger="kvserve.kvtier.ipc"):
        assert producer.send(*blocks_of(9, 4)) is None  # 4 blocks never fit a buffer of 3
    assert "kv_buffer_size" in caplog.text and producer.refused == 1
    wait_for(lambda: all(t in consumer.done for t in tids))
    for keys, kv in sent:
        for k, block in zip(keys, kv):
            assert torch.equal(store.staging.get(k), block)
    wait_for(lambda: not producer.ring.slots)  # every slot acknowledged
    assert producer.sent_blocks == consumer.received_blocks == 15 and not producer.dead


def test_a_slot_not_freed_in_time_gives_the_transfer_up():
    producer, consumer, store = connect(2 * BLOCK_BYTES, timeout_s=0.3)
    gate, read = threading.Event(), consumer.buffer.read
    consumer.buffer.read = lambda off, n: (gate.wait(), read(off, n))[1]  # a consumer that stalls
    first = producer.send(*blocks_of(0, 2))
    wait_for(lambda: producer.sent_blocks == 2)  # in the buffer, which it fills, and never acknowledged
    second = producer.send(*blocks_of(1, 1))
    wait_for(lambda: producer.dropped == 1)  # no room within transfer_timeout_s
    gate.set()
    wait_for(lambda: first in consumer.done and second in consumer.done)
    assert consumer.done[first] == 2 and consumer.done[second] == 0  # its request computes its prompt
    assert not producer.dead and not consumer.dead


@pytest.mark.unit
def test_host_buffer_handles_are_checked(tmp_path):
    with pytest.raises(ValueError, match="path"):
        SharedBuffer.open({"kind": "file", "path": str(tmp_path / (PREFIX + "x")), "nbytes": 10})
    with pytest.raises(ValueError, match="path"):
        SharedBuffer.open({"kind": "file", "path": "/etc/passwd", "nbytes": 10})
    with pytest.raises(ValueError, match="kind"):
        SharedBuffer.open({"kind": "pickle", "nbytes": 10})
    with pytest.raises(ValueError, match="size"):
        SharedBuffer.open({"kind": "cuda", "nbytes": True})


@pytest.mark.unit
def test_cuda_handle_is_plain_json():
    """What torch's reduce_tensor gives for a CUDA tensor goes through JSON and comes back as the
    same arguments; a name outside the few torch classes it carries is refused."""
    from kvserve.kvtier.ipc_buffer import _decode, _encode
    args = (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"\x01handle",
            4096, 512, False, b"/torch_1_2", 3, b"\x02event", True)
    assert tuple(_decode(json.loads(json.dumps(_encode(a)))) for a in args) == args
    with pytest.raises(ValueError):
        _decode({"name": "os.system"})
    with pytest.raises(TypeError):
        _encode(object)


@pytest.mark.unit
@pytest.mark.parametrize("cfg, field", [
    ({"kv_role": "kv_both"}, "kv_role"),
    ({"kv_role": "kv_consumer", "kv_rank": 0}, "kv_rank"),
    ({"kv_role": "kv_producer", "kv_buffer_size": 1000}, "kv_buffer_size"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"transfer_timeout_s": 0}}, "transfer_timeout_s"),
])
def test_bad_ipc_config(cfg, field):
    with pytest.raises(ConfigError) as e:
        KVTransferConfig.from_dict({"kv_connector": "CudaIpcConnector", **cfg})
    assert e.value.option.startswith("kv_transfer_config") and field in str(e.value)


# -- two processes on one GPU -------------------------------------------------------------------
CUDA_TINY = {**TINY, "device": "cuda"}


@needs_cuda
def test_cuda_ipc_one_gpu_matches_one_engine():
    prompts = TINY_PROMPTS + LONG_PROMPTS  # more than the 1 MiB buffer holds at once
    check_hand_over(CUDA_TINY, prompts, reference(CUDA_TINY, prompts, warm=True))


@needs_cuda
def test_cuda_ipc_producer_killed_means_local_prefill():
    port = free_port()
    producer = Producer({**CUDA_TINY, "kv_transfer_config": ipc_cfg("kv_producer", port)})
    try:
        llm = make_llm(CUDA_TINY, kv_transfer_config=ipc_cfg("kv_consumer", port,
                                                             kv_connector_extra_config={"transfer_timeout_s": 120}))
        assert producer.proc.stdout.readline().strip() == "ready"
        producer.proc.kill()
        producer.proc.wait(timeout=60)
        t0 = time.monotonic()
        outs = decode(llm, TINY_PROMPTS, [{"do_remote_prefill": True, "transfer_id": "x1"}] * len(TINY_PROMPTS))
        assert time.monotonic() - t0 < 60
        assert [o.metrics.num_loaded_tokens for o in outs] == [0] * len(TINY_PROMPTS)
        assert llm.engine.kv_transfer.consumer.dead
    finally:
        producer.close()
