"""PrefixPins under random operations (hypothesis): requests admitted with prefix hits and freed,
prefixes pinned and unpinned under several cache salts, time passing. After every operation the
pool's reference counts equal the tables' plus the pins' holds, pins stay within their budget,
every pinned block is still cached under a key of its own salt, and once all requests end and all
pins go every block is free."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.engine.kv_cache_manager import KVCacheManager, group_key
from kvserve.engine.prefix_pins import PrefixPins
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4
BASES = [random.Random(i).choices(range(1, 50), k=16) for i in range(3)]  # shared instructions
SALTS = [None, "tenant-a", "tenant-b"]


def prompts():
    return st.tuples(st.integers(0, len(BASES) - 1), st.integers(1, 16), st.lists(st.integers(1, 49), max_size=6),
                     st.sampled_from(SALTS)).map(lambda t: (BASES[t[0]][:t[1]] + t[2], t[3]))


class PinMachine(RuleBasedStateMachine):
    @initialize(windows=st.sampled_from([(None,), (None, 8)]), fraction=st.sampled_from([0.0, 0.2, 0.5]))
    def setup(self, windows, fraction):
        self.kv = KVCacheManager(24, BS, windows=windows)
        self.now = 0.0
        self.pins = PrefixPins(self.kv, fraction, ttl=5.0, clock=lambda: self.now)
        self.live: dict[str, Request] = {}
        self.seen: list[tuple[list[int], str | None]] = []  # prompts admitted: pins find them cached
        self.n = 0

    @rule(p=prompts())
    def admit(self, p):
        ids, salt = p
        req = Request(f"r{self.n}", list(ids) + [50], SamplingParams(max_tokens=1))
        self.n += 1
        req.cache_salt = salt
        computed = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_tokens - len(computed) * BS, computed):
            req.num_computed_tokens = req.num_tokens
            self.kv.free_out_of_window(req)
            self.live[req.request_id] = req
            self.seen.append((ids, salt))
        event("admitted" if req.request_id in self.live else "no room")

    @rule(data=st.data())
    def finish(self, data):
        if self.live:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.kv.free(self.live.pop(rid))

    @rule(p=prompts(), owner=st.sampled_from(["x", "y", "z"]), data=st.data())
    def pin(self, p, owner, data):
        ids, salt = data.draw(st.sampled_from(self.seen)) if self.seen and data.draw(st.booleans()) else p
        n = self.pins.pin(ids, salt, owner)
        event("pinned" if n else "nothing to pin")
        assert n % BS == 0 and n <= len(ids)
        if n:  # the pin holds exactly what a hit of n tokens under this salt needs
            keys = self.pins.keys_of(ids[:n], salt)
            want = set()
            for g in range(len(self.kv.windows)):
                for h in keys[self.kv.first_needed(g, n):]:
                    want.add(self.kv.pool.lookup(group_key(h, g)))
            assert None not in want and want <= set(self.pins.refs)

    @rule(owner=st.sampled_from(["x", "y", "z"]))
    def unpin(self, owner):
        self.pins.unpin(owner)
        assert all(owner not in pin.owners for pin in self.pins.pins.values())

    @rule(dt=st.floats(0.0, 4.0))
    def wait(self, dt):
        self.now += dt
        self.pins.expire()
        assert all(pin.expires > self.now for pin in self.pins.pins.values())

    @rule()
    def end_everything(self):
        for req in self.live.values():
            self.kv.free(req)
        self.live.clear()
        for owner in ("x", "y", "z"):
            self.pins.unpin(owner)
        assert not self.pins.pins and not self.pins.refs
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks

    @invariant()
    def consistent(self):
        if hasattr(self, "kv"):
            self.kv.check_invariants(list(self.live.values()), self.pins.held())
            self.pins.check()


PinMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_pin_machine = PinMachine.TestCase
