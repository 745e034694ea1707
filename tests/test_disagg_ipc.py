"""CudaIpcConnector (kvserve/kvtier/ipc.py): a prefill instance in another process of this host
hands its prompts' KV over by letting the decode instance copy the blocks out of its own KV pool,
which both processes map (CUDA IPC on a GPU, a host file on the CPU; the holds,
acknowledgements and landings are the same code). As for the gloo
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
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import KVTransferConfig
from kvserve.engine.block_pool import BlockPool
from kvserve.errors import ConfigError
from kvserve.kvtier import TieredStore, ipc_buffer
from kvserve.kvtier.ipc import IpcConsumer, IpcProducer, encode_transfer, shared_zeros
from kvserve.kvtier.ipc_buffer import PREFIX, SharedBuffer
from kvserve.kvtier.mailbox import Ring, ring_bytes
from kvserve.kvtier.transfer import Channel
from tests.server.server_proc import free_port
from tests.test_disagg import TINY, TINY_PROMPTS, Producer, decode, full_blocks, greedy, make_llm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC: needs CUDA")
_rng = random.Random(11)
# Four prompts of 43 full blocks (344 KiB of KV each): more than a kv_buffer_size of 1 MiB lets
# the producer hold at once (three would be 1,032 KiB), so they pass only if it releases each
# prompt's blocks once the consumer copied them.
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
    while True:
        llm.engine.housekeeping()  # (what the engine does before each step, and idle, lands them)
        if all(p.get("transfer_id") in consumer.done for p in params):
            return
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
        # One prompt at a time, each landed before the next: the blocks of prompts held beyond
        # kv_buffer_size would not be sent. (The producer checks its pool's references.)
        params = producer.prefill(prompts[:1])
        for p in prompts[1:]:
            wait_arrived(llm, params[-1:])
            params += json.loads(producer.ask([p]))
        assert all(p["do_remote_prefill"] and p["transfer_id"] and p["num_blocks"] > 0 for p in params)
        wait_arrived(llm, params)
        outs = decode(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [full_blocks(llm, p) for p in prompts]
        consumer = llm.engine.kv_transfer.consumer
        assert isinstance(consumer, IpcConsumer) and consumer.failed_transfers == 0
        assert consumer.remote.device.type == torch.device(cfg["device"]).type
        assert producer.ask("drain").strip() == "drained"  # every held block released
    finally:
        producer.close()


# -- two processes on the CPU ---------------------------------------------------------------
def test_ipc_prefill_then_decode_matches_one_engine(tiny_reference):
    check_hand_over(TINY, TINY_PROMPTS, tiny_reference)


def test_ipc_prompts_beyond_kv_buffer_size_pass_one_after_another():
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
        assert llm.engine.kv_transfer.consumer.dead
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


# -- holds, landings and acknowledgements, both ends in this process ----------------------------
SHAPE = (2, 3, 12, 4)  # a float32 pool [layers, K/V, 12 blocks, 4 values]: a block is 96 bytes
BLOCK_BYTES = 2 * 3 * 4 * 4


def connecting(buffer_bytes: int, local_blocks: int = 10) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Both ends connecting, each in a thread: the futures of the producer and the consumer, the
    producer's pool (random values) and the consumer's."""
    port, store = free_port(), TieredStore(SHAPE[:2] + SHAPE[3:], torch.float32, torch.device("cpu"))
    remote, shared = shared_zeros(SHAPE, torch.float32, torch.device("cpu"))
    remote.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)))
    local = torch.zeros(SHAPE[:2] + (local_blocks,) + SHAPE[3:])

    def side(role):
        ch = Channel(KVTransferConfig("CudaIpcConnector", role, kv_port=port), torch.device("cpu"))
        if role == "kv_producer":
            return IpcProducer(ch, shared, SHAPE, torch.float32, BLOCK_BYTES, buffer_bytes)
        return IpcConsumer(ch, store, 30.0, local)

    with ThreadPoolExecutor(2) as ex:
        return [ex.submit(side, role) for role in ("kv_producer", "kv_consumer")], remote, local


def connect(buffer_bytes: int, local_blocks: int = 10) -> tuple[IpcProducer, IpcConsumer, torch.Tensor, torch.Tensor]:
    (producer, consumer), remote, local = connecting(buffer_bytes, local_blocks)
    return producer.result(), consumer.result(), remote, local


def keys_of(i: int, n: int) -> list[bytes]:
    return [f"t{i}-b{j}".encode().ljust(32, b".") for j in range(n)]


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def released(producer: IpcProducer, timeout: float = 30.0) -> list[list[int]]:
    """The producer engine's housekeeping until nothing is held: the blocks it released."""
    out: list[list[int]] = []

    def empty():
        out.extend(producer.take_released())
        return not producer.held
    wait_for(empty, timeout)
    return out


def arrived(consumer: IpcConsumer) -> bool:
    return consumer.receive() > 0 or bool(consumer.inbox)


def land_until(consumer: IpcConsumer, pool: BlockPool, local: torch.Tensor, tids: list[str]) -> None:
    """The consumer engine's step loop, reduced to its landing."""
    def landed():
        consumer.land(pool, local)
        return all(t in consumer.done for t in tids)
    wait_for(landed)


def test_a_buffer_smaller_than_a_block_is_refused_on_both_sides():
    (producer, consumer), _, _ = connecting(BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="kv_buffer_size.*cannot hold one KV block"):
        producer.result()
    with pytest.raises(ConfigError, match="kv_buffer_size.*could not share"):  # (not left waiting)
        consumer.result()


def test_rings_that_do_not_fit_the_host_name_kv_buffer_size(monkeypatch):
    """The pool is shared; then the rings find no room in any shared-memory directory. The
    error names the option that sizes the rings, not kv_cache_memory, and the consumer is told."""
    real_free, real_zeros = ipc_buffer._free, shared_zeros

    def pool_with_room(*args):
        with monkeypatch.context() as m:
            m.setattr(ipc_buffer, "_free", real_free)
            return real_zeros(*args)
    monkeypatch.setattr(ipc_buffer, "_free", lambda d: 0)
    monkeypatch.setattr(sys.modules[__name__], "shared_zeros", pool_with_room)
    (producer, consumer), _, _ = connecting(12 * BLOCK_BYTES)
    with pytest.raises(ConfigError, match=r"kv_transfer_config\.kv_buffer_size.*free space.*rings") as e:
        producer.result()
    assert "kv_cache_memory" not in str(e.value)
    with pytest.raises(ConfigError, match="kv_buffer_size.*could not share"):
        consumer.result()


def test_held_blocks_land_byte_exact_and_are_released():
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES)
    # The file's name is gone once both processes mapped it: nothing is left if they die.
    assert consumer.buffer.handle["path"] and not os.path.exists(consumer.buffer.handle["path"])
    pool = BlockPool(10)
    sent = {"a": (keys_of(0, 3), [7, 2, 9]), "b": (keys_of(1, 2), [0, 1]), "c": (keys_of(2, 1), [11])}
    for tid, (keys, ids) in sent.items():
        assert producer.send(tid, keys, ids)
    land_until(consumer, pool, local, list(sent))
    for tid, (keys, ids) in sent.items():
        assert consumer.done[tid] == len(keys)
        for k, src in zip(keys, ids):
            dst = pool.lookup(k)  # registered in the prefix cache, free until a request revives it
            assert dst is not None and pool.blocks[dst].ref_cnt == 0
            assert torch.equal(local[:, :, dst], remote[:, :, src])
    pool.check_invariants()
    assert pool.num_free_blocks == 10
    assert sorted(map(tuple, released(producer))) == sorted(tuple(ids) for _, ids in sent.values())
    assert producer.held_blocks == [] and producer.sent_blocks == consumer.received_blocks == 6


def test_holds_beyond_kv_buffer_size_are_not_sent():
    producer, consumer, _, local = connect(3 * BLOCK_BYTES)
    pool = BlockPool(10)
    assert producer.send("a", keys_of(0, 2), [0, 1])
    assert not producer.send("b", keys_of(1, 2), [2, 3]) and producer.dropped == 1  # 4 > 3 blocks held
    assert producer.send("c", keys_of(2, 1), [4])
    assert sorted(producer.held_blocks) == [0, 1, 4]
    land_until(consumer, pool, local, ["a", "c"])
    assert sorted(b for ids in released(producer) for b in ids) == [0, 1, 4]
    assert producer.send("d", keys_of(3, 3), [5, 6, 7])  # room again


def test_a_full_pool_lands_a_prefix_and_cached_keys_are_not_copied():
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES, local_blocks=4)
    pool = BlockPool(4)
    busy = pool.allocate(2)  # two blocks in use by running requests: never taken
    keys = keys_of(0, 4)
    assert producer.send("a", keys, [3, 4, 5, 6])
    land_until(consumer, pool, local, ["a"])
    assert consumer.done["a"] == 2 and consumer.partial_transfers == 1  # the rest is computed
    assert [pool.lookup(k) is not None for k in keys] == [True, True, False, False]
    assert all(pool.blocks[b].ref_cnt == 1 and pool.blocks[b].block_hash is None for b in busy)
    before = local.clone()
    assert producer.send("b", keys[:2], [8, 9])  # the same keys from other blocks: already here
    land_until(consumer, pool, local, ["b"])
    assert consumer.done["b"] == 2 and torch.equal(local, before)
    assert torch.equal(local[:, :, pool.lookup(keys[0])], remote[:, :, 3])
    pool.check_invariants()


def test_cached_blocks_a_landing_evicts_are_spilled_before_being_overwritten():
    """With KV tiers the pool records its evictions for the runner to copy out at the next step;
    a landing overwrites the blocks it takes at once, so it must hand them to the tiers first, and
    not leave them for the step (which would store the landed bytes under the evicted keys)."""
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES, local_blocks=4)
    pool = BlockPool(4)
    pool.record_evictions = True
    old = keys_of(9, 4)
    for b, k in zip(pool.allocate(4), old):  # four cached blocks of earlier requests, free
        local[:, :, b] = 1000 + b
        pool.cache_block(b, k)
        pool.free([b])
    spilled = []
    assert producer.send("a", keys_of(0, 2), [3, 7])
    wait_for(lambda: arrived(consumer))
    consumer.land(pool, local, lambda ev: spilled.extend((b, k, local[:, :, b].clone()) for b, k in ev))
    assert [k for _, k, _ in spilled] == old[:2]  # the two least recently freed
    for b, _, kv in spilled:  # what the tiers got: the old bytes, not the landed ones
        assert torch.equal(kv, torch.full_like(kv, 1000 + b))
        assert not torch.equal(local[:, :, b], kv)  # (overwritten after the spill)
    assert pool.evicted == []  # nothing left for the step to copy out of overwritten blocks
    assert torch.equal(local[:, :, pool.lookup(keys_of(0, 2)[1])], remote[:, :, 7])
    pool.check_invariants()


def test_acknowledgements_a_full_ring_refuses_wait_and_landing_goes_on():
    """A producer that does not take its acknowledgements (a long step, paused) must not stall
    the consumer's steps: acknowledgements the ring has no room for wait on the consumer's side,
    landings go on, and the waiting ones go out once the producer made room."""
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES)
    room, put = [0], consumer.acks.put
    consumer.acks.put = lambda m: room[0] > 0 and (room.__setitem__(0, room[0] - 1) or put(m))
    pool = BlockPool(10)
    assert producer.send("a", keys_of(0, 2), [0, 1]) and producer.send("b", keys_of(1, 2), [2, 3])
    t0 = time.monotonic()
    land_until(consumer, pool, local, ["a", "b"])
    consumer.land(pool, local)
    assert time.monotonic() - t0 < 10 and list(consumer.acks_waiting) == [b"a", b"b"]
    assert producer.take_released() == [] and producer.held.keys() == {"a", "b"}
    room[0] = 1  # room for one: the oldest goes first
    consumer.land(pool, local)
    assert producer.take_released() == [[0, 1]] and list(consumer.acks_waiting) == [b"b"]
    room[0] = 9
    consumer.land(pool, local)
    assert released(producer) == [[2, 3]]


def test_a_failed_landing_leaks_nothing_and_is_acknowledged(caplog):
    producer, consumer, _, local = connect(12 * BLOCK_BYTES, local_blocks=4)
    pool = BlockPool(4)
    pool.record_evictions = True
    for b, k in zip(pool.allocate(4), keys_of(9, 4)):  # cached blocks, so the landing evicts
        pool.cache_block(b, k)
        pool.free([b])

    def spill(evicted):
        raise OSError("the disk tier is full")
    assert producer.send("a", keys_of(0, 2), [3, 7])
    wait_for(lambda: arrived(consumer))
    with caplog.at_level(logging.ERROR, logger="kvserve.kvtier.ipc"):
        consumer.land(pool, local, spill)
    assert "could not be landed" in caplog.text
    assert consumer.done["a"] == 0 and consumer.failed_transfers == 1  # its request computes its prompt
    assert pool.num_free_blocks == 4 and all(pool.lookup(k) is None for k in keys_of(0, 2))
    pool.check_invariants()
    assert released(producer) == [[3, 7]]  # the hold is released all the same


def test_a_landing_keeps_the_cached_blocks_it_skips():
    """Of a transfer's keys, those cached here already are not copied; the allocation for the
    others must not evict them (they are the oldest cached blocks here)."""
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES, local_blocks=4)
    pool = BlockPool(4)
    keys = keys_of(0, 4)
    for b, k in zip(pool.allocate(2), keys[:2]):
        pool.cache_block(b, k)
        pool.free([b])
    assert producer.send("a", keys, [3, 4, 5, 6])
    land_until(consumer, pool, local, ["a"])
    assert [pool.lookup(k) is not None for k in keys] == [True, True, True, True]
    assert consumer.done["a"] == 4 and consumer.partial_transfers == 0
    assert torch.equal(local[:, :, pool.lookup(keys[3])], remote[:, :, 6])
    pool.check_invariants()


def test_asleep_transfers_wait_and_land_in_the_pool_of_the_wake():
    """Asleep the engine has no KV tensor: transfers wait; after the wake they land in the new
    one (never in the tensor of before the sleep)."""
    producer, consumer, remote, local = connect(12 * BLOCK_BYTES)
    pool = BlockPool(10)
    assert producer.send("a", keys_of(0, 2), [4, 5])
    wait_for(lambda: arrived(consumer))
    consumer.land(pool, None)
    assert "a" not in consumer.done and len(consumer.inbox) == 1
    woken = torch.zeros_like(local)
    land_until(consumer, pool, woken, ["a"])
    assert torch.equal(woken[:, :, pool.lookup(keys_of(0, 2)[1])], remote[:, :, 5])
    assert not local.any()


def test_an_unknown_acknowledgement_keeps_the_holds(caplog):
    """A consumer that breaks the protocol may still be copying: the producer stops sending but
    releases nothing it holds (a bounded loss, where releasing could hand reused blocks over)."""
    producer, consumer, _, _ = connect(12 * BLOCK_BYTES)
    assert producer.send("a", keys_of(0, 2), [0, 1])
    wait_for(lambda: arrived(consumer))
    assert consumer.acks.put(b"never-sent")
    with caplog.at_level(logging.ERROR, logger="kvserve.kvtier.ipc"):
        assert producer.take_released() == []
    assert producer.dead and "unknown transfer" in caplog.text and "stay held" in caplog.text
    assert producer.held.keys() == {"a"} and producer.held_blocks == [0, 1] and producer.take_released() == []
    assert not producer.send("b", keys_of(1, 1), [2])


def _raw(tid: bytes, slot: int, n: int, width: int, tail: bytes) -> bytes:
    import struct
    return struct.pack("<HhII", len(tid), slot, n, width) + tid + tail


@pytest.mark.parametrize("message", [
    encode_transfer("x", keys_of(0, 1), [12]),  # a block beyond the producer's pool
    encode_transfer("x", keys_of(0, 1), [-1]),
    encode_transfer("x", keys_of(0, 1), [2**31 - 1]),
    encode_transfer("x", keys_of(0, 1), [1], slot=0),  # an event the CPU producer never shared
    encode_transfer("x", keys_of(0, 1), [1])[:-1],  # a byte short
    encode_transfer("x", keys_of(0, 1), [1]) + b"!",
    _raw(b"x", -1, 2**32 - 1, 32, b"\0" * 36),  # more blocks than the message holds
    _raw(b"x", -1, 1, 0, b"\0" * 4),  # keys of no bytes
    _raw(b"x" * 65, -1, 0, 32, b""),  # an id over 64 bytes
    _raw(b"x", -2, 0, 32, b""),
    b"\1\2",
], ids=["beyond", "negative", "huge", "slot", "short", "long", "count", "keyless", "id", "slot-2", "tiny"])
def test_a_malformed_transfer_ends_the_connection_not_the_engine(message):
    producer, consumer, _, local = connect(12 * BLOCK_BYTES)
    assert producer.data.put(message)
    pool = BlockPool(10)
    consumer.land(pool, local)  # nothing lands, nothing breaks
    assert consumer.dead and pool.num_cached_blocks == 0 and not consumer.done and not consumer.inbox
    pool.check_invariants()


def test_a_corrupt_ring_ends_the_connection_not_the_engine(monkeypatch):
    """A frame that does not check out may still be on its way (a CPU that reorders stores): it
    is retried, and only after ``STALE_S`` the connection ends, on both sides: the producer is
    told and releases what it held."""
    from kvserve.kvtier import mailbox
    producer, consumer, _, local = connect(12 * BLOCK_BYTES)
    assert producer.send("a", keys_of(0, 1), [3]) and producer.send("b", keys_of(1, 1), [4])
    producer.data._ring[0:4] = 0xEE  # the first frame's length: beyond what the ring holds
    pool = BlockPool(10)
    consumer.land(pool, local)
    assert not consumer.dead and not consumer.done  # (not taken: tried again at the next landing)
    monkeypatch.setattr(mailbox, "STALE_S", 0.0)
    time.sleep(0.01)
    consumer.land(pool, local)
    assert consumer.dead and not consumer.done and pool.num_cached_blocks == 0
    pool.check_invariants()
    wait_for(lambda: producer.dead)
    assert sorted(b for ids in released(producer) for b in ids) == [3, 4]
    assert not producer.send("c", keys_of(2, 1), [5])


def test_a_consumer_that_ends_the_transfer_tells_the_producer_after_its_copies():
    """A bad message after good ones: the good ones that landed are acknowledged, then the
    producer hears the consumer ended and releases the rest; nothing stays held."""
    producer, consumer, _, local = connect(12 * BLOCK_BYTES)
    pool = BlockPool(10)
    assert producer.send("a", keys_of(0, 2), [0, 1])
    land_until(consumer, pool, local, ["a"])
    assert producer.send("b", keys_of(1, 1), [2])
    assert producer.data.put(encode_transfer("x", keys_of(2, 1), [99]))  # beyond the producer's pool
    consumer.land(pool, local)
    assert consumer.dead and "b" not in consumer.done
    wait_for(lambda: producer.dead)
    assert sorted(b for ids in released(producer) for b in ids) == [0, 1, 2] and producer.held_blocks == []


@pytest.mark.parametrize("ring", ["data", "acks"])
@pytest.mark.parametrize("pos, value", [("_wpos", "misaligned"), ("_wpos", "behind"), ("_wpos", "ahead"),
                                        ("_rpos", "misaligned"), ("_rpos", "ahead")])
def test_positions_a_peer_wrote_wrong_end_the_connection_not_the_engine(ring, pos, value):
    """Each side reads the other's position from shared memory (the reader the write position,
    the writer the read position): out of line, it is a broken peer, not an exception in an
    engine step, and the producer ends up knowing."""
    producer, consumer, _, local = connect(12 * BLOCK_BYTES)
    pool = BlockPool(10)
    assert producer.send("a", keys_of(0, 1), [3])
    land_until(consumer, pool, local, ["a"])
    released(producer)
    r = getattr(producer, ring)
    view = r._wpos if pos == "_wpos" else r._rpos

    def corrupt():
        now = int(view[0])
        view[0] = {"misaligned": now + 4, "behind": now - 8, "ahead": now + 8 * r.capacity}[value]
    if (ring, pos) == ("data", "_rpos"):  # what the producer reads before it writes a transfer
        corrupt()
    sent = producer.send("b", keys_of(1, 1), [4])
    if (ring, pos) == ("data", "_wpos"):  # what the consumer reads before it takes one
        corrupt()
    if (ring, pos) == ("acks", "_rpos"):  # what the consumer reads before it writes an acknowledgement
        corrupt()
    consumer.land(pool, local)
    if (ring, pos) == ("acks", "_wpos"):  # what the producer reads before it takes one
        corrupt()
    got = []

    def steps():  # the consumer's steps, the producer's housekeeping (a frame that only looks
        consumer.land(pool, local)  # wrong is retried for STALE_S first)
        got.extend(producer.take_released())
        return producer.dead and not consumer.unacked
    wait_for(steps)
    assert sent == ((ring, pos) != ("data", "_rpos"))
    # The producer releases what a consumer that ended can no longer read; a consumer that broke
    # the protocol may still be reading: what it held stays held.
    kept = [4] if (ring, pos) == ("acks", "_wpos") else []
    got += producer.take_released()
    assert sorted(b for ids in got for b in ids) == ([4] if sent and not kept else [])
    assert producer.held_blocks == kept
    pool.check_invariants()


def test_garbage_on_the_channel_from_a_live_consumer_keeps_the_holds(caplog):
    """Only a channel that failed (the consumer's process gone) or the consumer's word that it
    ended releases held blocks: bytes on the channel that are not a message may come from a
    consumer still copying them."""
    producer, consumer, _, _ = connect(12 * BLOCK_BYTES)
    assert producer.send("a", keys_of(0, 2), [0, 1])
    assert consumer.receive() == 1  # (taken, not copied yet)
    with caplog.at_level(logging.ERROR, logger="kvserve.kvtier.ipc"):
        consumer.channel.send(torch.tensor([0x1234, 0, 1]), tag=1)
        wait_for(lambda: producer.dead)
    assert "stay held" in caplog.text
    assert producer.take_released() == [] and producer.held_blocks == [0, 1]


def test_an_empty_or_non_utf8_transfer_is_refused():
    producer, consumer, _, local = connect(12 * BLOCK_BYTES)
    assert not producer.send("e", [], []) and producer.dropped == 1 and not producer.held
    assert producer.data.put(_raw(b"\xff" * 64, -1, 1, 32, b"\0" * 36))  # would ack as 192 bytes
    pool = BlockPool(10)
    consumer.land(pool, local)
    consumer.land(pool, local)  # (the next step runs too)
    assert consumer.dead and not consumer.done


# -- the message rings ----------------------------------------------------------------------
def _ring(capacity: int = 256, max_payload: int = 100) -> tuple[Ring, Ring, np.ndarray]:
    """A writer's and a reader's view of one ring (as the two processes have)."""
    mem = np.zeros(ring_bytes(capacity), dtype=np.uint8)
    return Ring(mem, capacity, max_payload), Ring(mem, capacity, max_payload), mem


@pytest.mark.unit
def test_ring_carries_messages_in_order_across_its_end():
    writer, reader, _ = _ring()
    rng = random.Random(3)
    sent, got = [], []
    for _ in range(400):  # many times round the ring, in bursts the reader takes at random
        while True:
            m = rng.randbytes(rng.randrange(0, 101))
            if not writer.put(m):
                break
            sent.append(m)
        got += reader.take()
        if rng.random() < 0.3:
            got += reader.take()
    got += reader.take()
    assert got == sent and len(sent) > 400


@pytest.mark.unit
def test_ring_refuses_what_does_not_fit_and_keeps_what_it_holds():
    writer, reader, _ = _ring(capacity=256, max_payload=100)
    assert writer.put(b"a" * 100) and writer.put(b"b" * 100)
    assert not writer.put(b"c" * 40)  # 2 x 112 bytes taken of 256: 48 do not fit
    assert reader.take() == [b"a" * 100, b"b" * 100]
    assert writer.put(b"c" * 40) and reader.take() == [b"c" * 40]
    with pytest.raises(ValueError, match="over"):
        writer.put(b"d" * 101)


@pytest.mark.unit
def test_ring_waits_for_a_frame_not_yet_visible_then_refuses_a_bad_one(monkeypatch):
    from kvserve.kvtier import mailbox
    writer, reader, mem = _ring()
    assert writer.put(b"hello")
    mem[mailbox.HEADER + 8] ^= 1  # a payload byte not yet what the checksum covers
    assert reader.take() == []
    mem[mailbox.HEADER + 8] ^= 1
    assert reader.take() == [b"hello"]
    assert writer.put(b"again")
    mem[mailbox.HEADER + 24] ^= 1
    assert reader.take() == []
    monkeypatch.setattr(mailbox, "STALE_S", 0.0)
    time.sleep(0.01)
    with pytest.raises(mailbox.RingError, match="not one this protocol writes"):
        reader.take()


@pytest.mark.unit
@pytest.mark.parametrize("stale", ["length", "skip"])
def test_ring_never_takes_or_skips_on_a_header_of_an_earlier_lap(stale):
    """A reader that sees the new write position before the frame's header (a CPU that reorders
    stores) may read the header an earlier lap left there: a length, or a skip to the ring's
    start. Neither is taken for the new frame; once the header is visible, the frame is read."""
    writer, reader, mem = _ring(capacity=256, max_payload=100)
    ring = mem[128:]
    if stale == "skip":  # lap 1 ends with a skip marker at offset 240
        for m in (b"a" * 100, b"b" * 100):
            assert writer.put(m)
        assert reader.take() == [b"a" * 100, b"b" * 100]
        assert writer.put(b"c" * 40)  # 224 + 48 > 256: a skip at 224, the frame at 0
        assert reader.take() == [b"c" * 40]
        for m in (b"d" * 100, b"e" * 56):  # lap 2: 48..160, 160..224 (up to the old skip)
            assert writer.put(m)
        assert reader.take() == [b"d" * 100, b"e" * 56]
        old = ring[224:232].copy()
        assert old[:4].view(np.uint32)[0] == 0xFFFFFFFF
    else:
        for m in (b"a" * 8, b"b" * 8):
            assert writer.put(m)
        assert reader.take() == [b"a" * 8, b"b" * 8]
        old = ring[32:40].copy()  # nothing there yet: zeros, a frame of no bytes
    at = 224 if stale == "skip" else 32
    assert writer.put(b"f" * 8)
    new = ring[at:at + 8].copy()
    ring[at:at + 8] = old  # the new position is visible, the frame's header not yet
    assert reader.take() == []
    ring[at:at + 8] = new
    assert reader.take() == [b"f" * 8]


@pytest.mark.unit
def test_ring_refuses_a_skip_at_its_start_and_positions_out_of_line(monkeypatch):
    from kvserve.kvtier import mailbox
    monkeypatch.setattr(mailbox, "STALE_S", 0.0)
    writer, reader, mem = _ring()
    assert writer.put(b"x")
    mem[128:136] = np.frombuffer(mailbox._FRAME.pack(mailbox.SKIP, mailbox._crc(0, mailbox.SKIP)), np.uint8)
    assert reader.take() == []  # (a whole lap skipped: never)
    time.sleep(0.01)
    with pytest.raises(mailbox.RingError):
        reader.take()
    writer, reader, mem = _ring()
    reader._wpos[0] = 12
    with pytest.raises(mailbox.RingError, match="write position"):
        reader.take()
    writer, reader, mem = _ring()
    writer._rpos[0] = 8  # read ahead of what was written
    with pytest.raises(mailbox.RingError, match="read position"):
        writer.put(b"y")


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
    prompts = TINY_PROMPTS + LONG_PROMPTS  # more than a 1 MiB kv_buffer_size holds at once
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
